"""fxopt.optimize(DDP(model)) with the gradients' all-reduces inside the step graph
(`fxopt.distributed.ddp`): one graph with one all-reduce per bucket of gradients, DDP's reducer not run,
gradients and optimizer steps equal eager's, DDP's state usable after; one process (world size 1
on gloo, where a second reduction would not change a gradient, so the profiler counts the
all-reduces that ran). The two-process Llama is `test_llama_under_ddp_one_graph`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxopt

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class TwoLayers(nn.Module):
    """A model with a buffer (DDP broadcasts it) and a parameter that needs no gradient."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.second = nn.Linear(32, 4)
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        return (self.second(torch.relu(self.norm(self.first(x)))) * self.frozen).square().mean()


def _models():
    torch.manual_seed(0)
    model = TwoLayers()
    return model, copy.deepcopy(model)


def _gloo_all_reduces(fn) -> int:
    """How many all-reduces gloo ran during ``fn()``: the graph's and the reducer's alike."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(e.name == "gloo:all_reduce" for e in prof.events())


def _step(module, x):
    module(x).backward()


def test_ddp_step_is_one_graph_with_its_all_reduces(one_process_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ref = _models()
    ddp = DDP(model)
    optimized = fxopt.optimize(ddp, 1.0)
    x = torch.randn(8, 16)
    _step(optimized, x)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = optimized.plan
    reduces = [n for n in plan.graph.nodes if n.name.startswith("all_reduce")]
    # The six gradients (4.6 KB) in one bucket, as DDP's reducer buckets them (its first holds 1 MiB).
    assert len(optimized.plans) == 1 and len(reduces) == 1 and len(trainable) == 6, [n.name for n in plan.graph.nodes]
    # Reduced in place (`fxopt.passes.coalesce`): the bucket, the one buffer, is the copy the
    # gradients are gathered into; no node holds a second one.
    owner = reduces[0].storage
    bucket = plan.graph.nodes[owner]
    assert reduces[0].bytes == 0 and not reduces[0].recomputable and bucket.name.startswith("cat")
    assert bucket.bytes == sum(p.numel() * 4 for p in trainable)
    assert sum(n.bytes for n in plan.graph.nodes if n.storage == owner) == 0
    # The second step: the graph's one all-reduce ran, not DDP's one bucket besides; the gradients
    # are views of the reduced bucket.
    model.zero_grad(set_to_none=True)
    assert _gloo_all_reduces(lambda: _step(optimized, x)) == 1
    assert len({p.grad.untyped_storage().data_ptr() for p in trainable}) == 1
    _step(ref, x)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"gradient of {name}: {m}")
        else:
            assert p.grad is None
    # DDP as a synchronized step leaves it: its buffers broadcast at the next forward, its
    # modules their own classes; its eager step after fxopt's runs DDP's reducer (one bucket).
    assert ddp.require_backward_grad_sync and ddp.require_forward_param_sync
    assert type(model.first) is nn.Linear and "_fxopt_ddp_reduce" not in model.first.__dict__
    model.zero_grad(set_to_none=True)
    assert _gloo_all_reduces(lambda: _step(ddp, x)) == 1
    assert set(ddp.state_dict()) == {f"module.{k}" for k in model.state_dict()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ddp_optimizer_steps_match_eager(one_process_group, optimizer):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ref = _models()
    optimized = fxopt.optimize(DDP(model), 1.0)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[optimizer]
    opts = make(model.parameters()), make(ref.parameters())
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(8, 16, generator=g)
        for module, opt in zip((optimized, ref), opts):
            opt.zero_grad(set_to_none=True)
            _step(module, x)
            opt.step()
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # an Inductor compile of the forward and the backward
def test_inductor_keeps_the_all_reduces_in_the_backward(one_process_group):
    """With ``compiler="inductor"`` (the route docs/multi-device.md gives a DDP user for speed) the
    step is still fxopt's graph with its bucket's all-reduce inside: a profiled step runs one
    all-reduce, issued inside the compiled backward (DDP's reducer would issue its own after it,
    as autograd accumulates each gradient), the gradients land as views of the reduced bucket, equal
    eager's up to Inductor's float rounding, and the measured peak is within the budget."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile

    model, ref = _models()
    optimized = fxopt.optimize(DDP(model), 1.0, compiler="inductor")
    x = torch.randn(8, 16)
    _step(optimized, x)  # (compiles)
    model.zero_grad(set_to_none=True)
    with profile() as prof:
        _step(optimized, x)
    events = prof.events()
    reduces = [e for e in events if e.name == "gloo:all_reduce"]
    backward = [e for e in events if e.name == "CompiledFunctionBackward"]
    assert len(reduces) == 1 and len(backward) == 1, sorted({e.name for e in events})
    assert backward[0].time_range.start <= reduces[0].time_range.start < backward[0].time_range.end
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len({p.grad.untyped_storage().data_ptr() for p in trainable}) == 1
    _step(ref, x)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"gradient of {name}: {m}")
    model.zero_grad(set_to_none=True)
    peak = fxopt.measure_peak(_step, optimized, x, resident=[optimized])
    assert peak.peak_bytes <= optimized.plan.budget_bytes


def test_accumulation_and_no_sync_leave_it_to_the_reducer(one_process_group):
    """A step that starts with gradients held (accumulation) reduces the accumulated gradient, as
    DDP's reducer does: fxopt's graph of that step has no all-reduce, the reducer runs. Inside the
    user's ``no_sync()`` nothing is reduced."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ref = _models()
    ddp = DDP(model)
    optimized = fxopt.optimize(ddp, 1.0)
    x = torch.randn(8, 16)
    with ddp.no_sync():
        assert _gloo_all_reduces(lambda: _step(optimized, x)) == 0
    assert _gloo_all_reduces(lambda: _step(optimized, x)) == 1  # DDP's one bucket
    for _ in range(2):
        _step(ref, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad)
    assert not any(n.name.startswith("all_reduce") for plan in optimized.plans for n in plan.graph.nodes)


def test_settings_only_the_reducer_follows(one_process_group):
    """find_unused_parameters, static_graph, gradient_as_bucket_view and a recurrent layer keep
    DDP's reducer, saying why; fxopt.plan of a DDP plans the graph fxopt.optimize runs (all-reduces
    inside)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(8, 16)
    for setting, why in [("find_unused_parameters", "unused"), ("static_graph", "static_graph"),
                         ("gradient_as_bucket_view", "views of its buckets")]:
        model, ref = _models()
        with pytest.warns(UserWarning, match=why):
            optimized = fxopt.optimize(DDP(model, **{setting: True}), 1.0)
        _step(optimized, x)
        _step(ref, x)
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad)
        assert not any(n.name.startswith("all_reduce") for n in optimized.plan.graph.nodes)
    rnn = nn.LSTM(16, 4)
    with pytest.warns(UserWarning, match="_flat_weights"):
        fxopt.optimize(DDP(rnn), 1.0)
    model, _ = _models()
    plan = fxopt.plan(DDP(model), 1.0, (x,))
    assert sum(n.name.startswith("all_reduce") for n in plan.graph.nodes) == 1


@pytest.mark.slow  # two processes, three compiles each
def test_llama_under_ddp_one_graph():
    """A transformers Llama (2 layers) under DDP on 2 gloo processes (`ddp_steps`): fxopt at DDP
    with per-block checkpointing's measured peak plans one graph with one all-reduce per bucket of
    gradients and measures within its plan and the budget on both ranks, with single-process
    eager's loss and gradients (checked on each rank); a profiled step runs exactly the graph's
    all-reduces (not DDP's besides), the first starting before the backward's last matrix product
    ends."""
    pytest.importorskip("transformers")
    from ddp_steps import run

    results = run("llama")
    assert len(results) == 2
    for rank, rows in enumerate(results):
        r = rows["fxopt@ckpt"]
        where = f"rank {rank}: {rows}"
        assert r["measured"] <= r["predicted"] <= r["budget"], where
        assert r["budget"] >= rows["ddp+ckpt"]["measured"] and r["recomputed"] > 0, where
        # 2.25 MiB of gradients in two buckets, as DDP's reducer buckets them (the first closes past
        # 1 MiB, the second holds the rest, under 25 MiB).
        assert r["plans"] == 1 and r["all_reduces"] == 2 and r["params"] == 21, where
        assert r["comm_bytes"] == 2 * (len(results) - 1) * r["param_bytes"] // len(results), where
        order = rows["order"]
        assert order["all_reduces"] == r["all_reduces"], where
        assert order["first_all_reduce_start"] < order["last_mm_end"], where


class Tied(nn.Module):
    """An embedding tied to the output layer (one parameter read under two names: each read's
    gradient, 1 MiB, is all-reduced), and a hidden layer: more than DDP's first bucket (1 MiB)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1024, 256)
        self.hidden = nn.Linear(256, 256)
        self.head = nn.Linear(256, 1024, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.hidden(self.embed(ids)))).flatten(0, 1),
                                               ids.flatten())


def test_tied_parameters_and_buckets_past_the_first(one_process_group):
    """A tied parameter's two reads sum into one gradient; the reads' gradients fill two buckets
    (the first, the head's read, closes at 1 MiB, as DDP's first bucket); the measured peak is
    within the plan."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    optimized = fxopt.optimize(DDP(model), 1.0)
    ids = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(1))
    _step(optimized, ids)
    model.zero_grad(set_to_none=True)
    peak = fxopt.measure_peak(_step, optimized, ids, resident=[optimized])
    _step(ref, ids)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"gradient of {name}: {m}")
    plan = optimized.plan
    reduces = [n for n in plan.graph.nodes if n.name.startswith("all_reduce")]
    # (each bucket reduced in place: its bytes are the copy the gradients are gathered into)
    buckets = [plan.graph.nodes[n.storage] for n in reduces]
    assert len(reduces) == 2 and buckets[0].bytes >= 1 << 20, [(n.name, n.bytes) for n in buckets]
    assert peak.peak_bytes <= plan.peak_bytes <= plan.budget_bytes


def test_the_backward_waits_for_its_all_reduce_at_the_end(one_process_group, monkeypatch):
    """In the rewritten backward the bucket's all-reduce is issued once its last gradient is made,
    and waited for only where the gradients are returned (`fxopt.passes.waits`): every matrix
    product of the backward runs between the two."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxopt.plan_ahead import plan_and_rewrite

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    # Two buckets: the first closes at the last layer's gradients (132 bytes: a first bucket that small).
    from fxopt.passes import coalesce

    monkeypatch.setattr(coalesce, "FIRST_BUCKET_BYTES", 132)
    ready = plan_and_rewrite(DDP(model), 1.0, (torch.randn(8, 16),))
    nodes = list(ready.backward.graph.nodes)
    kinds = [getattr(n.target, "_opname", "") if n.op == "call_function" else n.op for n in nodes]
    reduces = [i for i, k in enumerate(kinds) if k == "all_reduce_"]  # (in place on each bucket)
    waits = [i for i, k in enumerate(kinds) if k == "wait_tensor"]
    mms = [i for i, k in enumerate(kinds) if k in ("mm", "addmm")]
    assert len(reduces) == len(waits) == 2, kinds
    # The first bucket (the last layer's gradients) issued before the other layers' products, its
    # wait after the last of them.
    assert reduces[0] < mms[-1] < waits[0], kinds


def test_a_call_swaps_the_classes_with_no_python_per_level_of_modules(one_process_group):
    """Issue 28: `fxopt.distributed.ddp`'s class swap walks the modules in one loop at every call
    (torch's ``modules()`` resumes a generator per level of nesting for every module it yields,
    and a context manager per module cost three calls more). Counted in Python calls: a model
    behind 40 more levels of modules costs under 100 more a call (without DDP's buffer broadcast,
    whose own walk, ``_assign_modules_buffers`` at each forward, eager DDP pays as much). Each
    module has its own class back after the call."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.test_step_overhead import nested, step_calls

    def calls(depth: int) -> int:
        model = nested(depth)
        classes = [type(m) for m in model.modules()]
        counted = step_calls(model, DDP(model, broadcast_buffers=False))
        assert [type(m) for m in model.modules()] == classes
        return counted

    shallow, deep = calls(1), calls(41)
    assert deep - shallow < 100, (shallow, deep)


def test_a_call_writes_no_modules_dict(one_process_group):
    """Issue 28: the reading classes carry the group's name and scale, so a call writes no
    submodule's ``__dict__`` (before, every module with a trainable parameter had a key set and
    deleted at every call, which Dynamo's guards on it see as a changed dictionary: torch 2.11
    checks them by their version tags), and swaps the classes without ``nn.Module.__setattr__``
    (before: its Python and two ``isinstance`` checks of a ``Parameter`` per module, twice a call).
    The wrapped module's own ``__dict__`` still has DDP's call routed to fxopt's step at each call
    (`fxopt.distributed.data_parallel.routed`). Counted, not timed."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.test_step_overhead import dict_versions, frames_in, nested

    model = nested(3)
    classes = [type(m) for m in model.modules()]
    optimized = fxopt.optimize(DDP(model, broadcast_buffers=False), 1.0)
    x = torch.randn(4, 8)

    def step():
        model.zero_grad(set_to_none=True)
        optimized(x).sum().backward()

    for _ in range(3):
        step()
    before = dict_versions(model)
    step()
    assert before is None or dict_versions(model)[1:] == before[1:]
    setattrs = [f for f in frames_in(step, "torch/nn/modules/module.py", called_from=("/fxopt/",))
                if f.startswith("__setattr__")]
    assert len(setattrs) == 3, setattrs  # (the route set and reset, DDP's forward-sync flag; 7 before here)
    assert [type(m) for m in model.modules()] == classes
