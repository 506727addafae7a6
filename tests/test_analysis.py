"""The analysis never guesses in the unsafe direction: an op whose scratch memory cannot be
measured is assumed to hold a conservative amount, never zero; an op whose FLOPs cannot be counted
is never offered for recomputation."""

from __future__ import annotations

import dataclasses
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from fxopt.analysis import costs, scratch
from fxopt.analysis.joint import _is_recomputable, _op_class
from fxopt.options import Options


@torch.library.custom_op("fxopt_test::fails_on_real_inputs", mutates_args=())
def fails_on_real_inputs(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this op cannot run on made-up inputs")


@fails_on_real_inputs.register_fake
def _(x):
    return torch.empty_like(x)


def one_op_graph(target, *shapes) -> fx.Node:
    graph = fx.Graph()
    with FakeTensorMode() as mode:
        args = []
        for k, shape in enumerate(shapes):
            p = graph.placeholder(f"x{k}")
            p.meta["val"] = torch.empty(shape)
            args.append(p)
        node = graph.call_function(target, tuple(args))
        node.meta["val"] = target(*(a.meta["val"] for a in args))
    del mode
    graph.output(node)
    return node


def test_an_op_that_cannot_be_measured_is_assumed_to_hold_more_than_its_tensors(caplog):
    node = one_op_graph(torch.ops.fxopt_test.fails_on_real_inputs.default, (256, 64))
    scratch._cache.clear()
    increases = scratch.op_increases([node])
    tensor_bytes = 2 * 256 * 64 * 4  # its input and its output
    assert increases[node] == scratch.UNMEASURED_FACTOR * tensor_bytes > 0
    assert "could not measure the scratch memory" in caplog.text


def test_an_op_that_can_be_measured_is_measured():
    node = one_op_graph(torch.ops.aten.relu.default, (64, 32))
    scratch._cache.clear()
    assert scratch.known_increase(node) is None
    assert 64 * 32 * 4 <= scratch.op_increases([node])[node] < scratch.UNMEASURED_FACTOR * 2 * 64 * 32 * 4


def _graph_of(fn, *inputs) -> list[fx.Node]:
    """The aten nodes of ``fn`` traced on fake ``inputs`` (given as real tensors: shape, stride)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_ops_known_to_allocate_only_their_outputs_do_so_when_measured():
    """Every op `known_increase` answers for, in each layout it accepts (contiguous, transposed),
    allocates exactly what it says when measured; a layout it refuses (a sliced column) is
    measured instead."""
    x, w, b = torch.randn(48, 40), torch.randn(40, 24), torch.randn(24)
    cases = [
        lambda x, w, b: torch.mm(x, w), lambda x, w, b: torch.mm(x, w.t().contiguous().t()),
        lambda x, w, b: torch.addmm(b, x, w), lambda x, w, b: torch.bmm(x.view(6, 8, 40), w.expand(6, 40, 24).contiguous()),
        lambda x, w, b: torch.log_softmax(x, -1), lambda x, w, b: torch.softmax(x, 0),
        lambda x, w, b: torch.ops.aten._log_softmax_backward_data(x, x.exp(), 1, torch.float32),
        lambda x, w, b: torch.ops.aten._softmax_backward_data(x, x.exp(), 1, torch.float32),
        lambda x, w, b: torch.nn.functional.nll_loss(x, torch.zeros(48, dtype=torch.long)),
        lambda x, w, b: torch.autograd.grad(torch.nn.functional.nll_loss(
            xx := x.detach().requires_grad_(), torch.zeros(48, dtype=torch.long)), xx)[0],
    ]
    checked = 0
    for fn in cases:
        for node in _graph_of(fn, x, w, b):
            if scratch.known_increase(node) is None:
                continue
            scratch._cache.clear()
            measured = scratch._measure({scratch._signature(node, int): node}, int)
            assert measured, node
            assert scratch._cache[scratch._signature(node, int)] == scratch.known_increase(node), node
            checked += 1
    assert checked >= 10
    sliced = _graph_of(lambda x, w, b: torch.mm(x[:, ::2], w[::2]), x, w, b)
    assert all(scratch.known_increase(n) is None for n in sliced if n.target is torch.ops.aten.mm.default)


def test_scratch_measured_at_one_thread_count_is_not_reused_at_another(tmp_path, monkeypatch):
    """A kernel's workspace depends on the threads that run it: a process that changes
    ``torch.set_num_threads`` measures again, in memory and on disk, instead of reusing the other
    count's figure."""
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXOPT_CACHE", "1")
    node = next(n for n in _graph_of(lambda x: torch.nn.functional.conv2d(x, x[:2]), torch.randn(4, 3, 8, 8))
                if n.target is torch.ops.aten.convolution.default)
    threads = torch.get_num_threads()
    keys, files = set(), set()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            scratch._cache.clear()
            scratch._on_disk.clear()
            scratch.op_increases([node])
            keys |= set(scratch._cache)
            files.add(scratch._disk_path())
    finally:
        torch.set_num_threads(threads)
    assert len(keys) == 2 and len(files) == 2


def test_an_op_whose_flops_cannot_be_counted_is_not_recomputed(monkeypatch):
    node = one_op_graph(torch.ops.aten.mm.default, (64, 32), (32, 16))
    assert costs.flops_of(node) == 2 * 64 * 32 * 16 and _is_recomputable(node)

    def broken(*args, **kwargs):
        raise TypeError("this formula does not fit")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, broken)
    assert costs.flops_of(node) is None
    assert not _is_recomputable(node)


def test_ops_torch_counts_as_free_stay_recomputable():
    node = one_op_graph(torch.ops.aten.relu.default, (64, 32))
    assert costs.flops_of(node) == 0 and _is_recomputable(node)


def test_cost_model_adds_compute_traffic_and_overhead():
    model = costs.CostModel(flops_per_second=1e9, bytes_per_second=1e8, op_overhead=1e-3)
    assert model.seconds(2_000_000_000, 300_000_000, False) == 2.0 + 3.0 + 1e-3
    assert model.seconds(2_000_000_000, 300_000_000, True) == 1e-4  # a view moves nothing


def test_a_fused_pointwise_op_costs_its_flops_at_the_rate():
    """Priced as fused into the kernel that reads it (issue 28), a pointwise op costs its FLOPs at
    the rate and a tenth of an op's overhead, no memory traffic. Op by op (the default) it moves
    its bytes as before; an op of another class costs the same either way."""
    fused = costs.CostModel(flops_per_second=1e9, bytes_per_second=1e8, op_overhead=1e-3, fused_pointwise=True)
    assert fused.seconds(2_000_000_000, 300_000_000, False, pointwise=True) == 2.0 + 1e-4
    assert fused.seconds(2_000_000_000, 300_000_000, False) == 2.0 + 3.0 + 1e-3
    unfused = dataclasses.replace(fused, fused_pointwise=False)
    assert unfused.seconds(2_000_000_000, 300_000_000, False, pointwise=True) == 2.0 + 3.0 + 1e-3
    assert costs.CostModel().fused_pointwise is False
    assert Options.of(0.5, compiler="inductor").cost_model.fused_pointwise is False  # (see CostModel: not yet)


@pytest.mark.parametrize("target, extra, expected", [
    (torch.ops.aten.gelu.default, (), "pointwise"),
    (torch.ops.aten.mul.Tensor, (2.0,), "pointwise"),
    (torch.ops.aten.where.self, ("x", "x"), "pointwise"),
    (torch.ops.aten.mm.default, ("x",), "matmul"),
    # Reductions keep their full price: Inductor runs each as a kernel that reads its input.
    (torch.ops.aten.native_layer_norm.default, ([32], None, None, 1e-5), ""),
    (torch.ops.aten._softmax.default, (1, False), ""),
    (torch.ops.aten.sum.default, (), ""),
])
def test_pointwise_ops_are_their_own_class(target, extra, expected):
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, (x, *(x if a == "x" else a for a in extra)))
    assert _op_class(node) == expected


def test_a_dtype_cast_is_pointwise():
    node = one_op_graph(torch.ops.aten._to_copy.default, (64, 32))
    node.kwargs = {"dtype": torch.float16}
    with FakeTensorMode():
        node.meta["val"] = torch.empty(64, 32, dtype=torch.float16)
    assert _op_class(node) == "pointwise"


def test_the_fused_pricing_holds_at_every_shape():
    """`SymbolicGraph.at` prices each node again at a shape (dynamic shapes, max_batch): a
    pointwise node keeps its fused price there, its memory traffic still counted op by op."""
    from fxopt.analysis.symbolic import NodeSizes, Ranges, SymbolicGraph, symbol
    from fxopt.solvers.graph import Graph, Node

    batch = symbol("batch")
    graph = Graph((Node("x", "input"), Node("g", "forward", inputs=(0,), op_class="pointwise"),
                   Node("y", "forward", inputs=(1,))))
    sizes = (NodeSizes(bytes=4 * batch), NodeSizes(bytes=4 * batch, moved=8 * batch, flops=batch),
             NodeSizes(bytes=4 * batch, moved=8 * batch))
    model = costs.CostModel(flops_per_second=1e9, bytes_per_second=1e8, op_overhead=1e-3)
    ranges = Ranges({"batch": (1, 1000)})
    for fused, pointwise_cost in ((True, 1e-6 + 1e-4), (False, 1e-6 + 8e-5 + 1e-3)):
        symbolic = SymbolicGraph(graph, sizes, ranges, {"batch": 1000}, dataclasses.replace(model, fused_pointwise=fused))
        at = symbolic.at({"batch": 1000})
        assert at.nodes[1].cost == pytest.approx(pointwise_cost)
        assert at.nodes[2].cost == pytest.approx(8e-5 + 1e-3)  # not pointwise: the same either way


def test_scratch_measurements_are_cached_on_disk_per_machine(tmp_path, monkeypatch):
    """A second process (here: a cleared in-process cache) reads measurements from disk instead of
    running the ops again; an unmeasurable op's estimate is not written; FXOPT_CACHE=0 keeps
    nothing; a damaged file is ignored and replaced."""
    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    mm = one_op_graph(torch.ops.aten.relu.default, (64, 32))
    bad = one_op_graph(torch.ops.fxopt_test.fails_on_real_inputs.default, (256, 64))
    runs = []
    real_measure = scratch._measure
    monkeypatch.setattr(scratch, "_measure", lambda todo, at: runs.append(len(todo)) or real_measure(todo, at))

    def fresh_process():
        scratch._cache.clear()
        scratch._on_disk.clear()

    fresh_process()
    first = scratch.op_increases([mm, bad])
    files = list((tmp_path / "scratch").glob("*.json"))
    assert len(files) == 1 and runs == [2]
    fresh_process()
    assert scratch.op_increases([mm, bad]) == first
    assert runs == [2, 1]  # the unmeasurable op is tried again, mm is read from disk

    files[0].write_text("{not json")
    fresh_process()
    assert scratch.op_increases([mm]) == {mm: first[mm]} and runs[-1] == 1

    monkeypatch.setenv("FXOPT_CACHE", "0")
    fresh_process()
    scratch.op_increases([mm])
    assert runs[-1] == 1


def test_a_backward_tagged_constant_that_a_forward_value_reads_is_a_forward_value():
    """AOTAutograd tags constants the backward uses as backward (`partitioner_tag`); one read by
    a forward value (a view of it the backward needs) is made in the forward, so that
    recomputing that view never waits for a value the backward has not made (a transformers
    Longformer's ``arange`` did: `InvalidScheduleError`). One only backward values read stays
    in the backward."""
    from fxopt.analysis.joint import _backward_nodes

    g = fx.Graph()
    primal, tangent = g.placeholder("primals_1"), g.placeholder("tangents_1")
    read_by_forward = g.call_function(torch.ops.aten.arange.default, (4,))
    read_by_backward = g.call_function(torch.ops.aten.ones.default, ([4],))
    for const in (read_by_forward, read_by_backward):
        const.meta["partitioner_tag"] = "is_backward"
    view = g.call_function(torch.ops.aten.view.default, (read_by_forward, [2, 2]))
    out = g.call_function(torch.ops.aten.sin.default, (primal,))
    grad = g.call_function(torch.ops.aten.mul.Tensor, (tangent, view))
    grad = g.call_function(torch.ops.aten.add.Tensor, (grad, read_by_backward))
    g.output((out, grad))
    nodes = list(g.nodes)
    backward = _backward_nodes(g, nodes, {out}, {grad})
    assert read_by_forward not in backward and view not in backward
    assert read_by_backward in backward and grad in backward and out not in backward


class _SavingBlock(torch.nn.Module):
    """Ops whose autograd nodes save inputs, outputs, views and items of a tuple."""

    def __init__(self, width=32):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.fc(self.norm(x)).view(x.shape[0], 2, -1)
        h = torch.nn.functional.gelu(h).max(dim=1).values  # (max saves its indices, an item)
        return x + self.drop(torch.tanh(h) * x.sigmoid())


def _eager_saves_of(blocks: int):
    from fxopt.analysis.eager_saves import eager_saves
    from fxopt.analysis.joint import _backward_nodes
    from fxopt.plan_ahead import plan_and_rewrite

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_SavingBlock() for _ in range(blocks)])
    joint = plan_and_rewrite(model, 1.0, (torch.randn(4, 32, requires_grad=True),)).joint
    nodes = [n for n in joint.module.graph.nodes if n.op != "output"]
    outs = list(next(iter(joint.module.graph.find_nodes(op="output"))).args[0])
    fwd = {o for o in outs[:joint.num_fwd_outputs] if isinstance(o, fx.Node)}
    bwd = {o for o in outs[joint.num_fwd_outputs:] if isinstance(o, fx.Node)}
    return lambda: eager_saves(nodes, _backward_nodes(joint.module.graph, nodes, fwd, bwd), outs[joint.num_fwd_outputs:])


@pytest.mark.slow
def test_eager_saves_runs_each_op_of_a_repeated_block_once(monkeypatch):
    """A step of N copies of one block runs each forward op once per signature, not once per
    copy (counted: the ops run on fake tensors do not grow with N), and its answer is the one
    running every op gives."""
    import fxopt.analysis.eager_saves as saves

    run, runs = saves._run, []
    monkeypatch.setattr(saves, "_run", lambda n, rg: runs.append(n) or run(n, rg))
    counts = {}
    for blocks in (2, 6):
        answer = _eager_saves_of(blocks)
        runs.clear()
        once = answer()
        counts[blocks] = len(runs)
        with monkeypatch.context() as every:
            every.setattr(saves, "_run_once", lambda n, rg, answers: saves._run(n, rg))
            assert answer() == once
        assert any(len(saved) > 1 for saved in once.values())
    assert counts[6] == counts[2] > 0


class _TinyLM(torch.nn.Module):
    """Embedding, a block, a vocabulary head and the cross-entropy loss (whose backward the planner
    writes in place: `fxopt.passes.loss`), with dropout where ``p``."""

    def __init__(self, p: float | None):
        super().__init__()
        self.emb, self.fc, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)
        self.drop = torch.nn.Dropout(p) if p else torch.nn.Identity()

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + self.drop(torch.tanh(self.fc(h)))
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 64), labels.view(-1))


@pytest.mark.parametrize("p", [None, 0.1])
def test_the_rewritten_step_reads_what_the_rewrite_left_alone_from_the_analysis_before_it(monkeypatch, p):
    """The planner analyses the step as captured, rewrites it in place (the loss's backward; with
    dropout, the forward's dropout too) and analyses it again, giving the first analysis
    (``earlier``): the second is the one a fresh analysis makes, and where the rewrite left the
    forward alone no forward op is run again for what eager saves, and only the nodes the
    rewrite touched have their scratch looked up (counted: the ops run and the nodes asked)."""
    import fxopt.analysis.eager_saves as saves
    import fxopt.analysis.joint as joint_module
    from fxopt.fxgraph import copy_module
    from fxopt.passes.dropout import alias_identity_dropouts
    from fxopt.plan_ahead import plan_each
    from fxopt.planner import _rewrite_for_planning

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    options = Options.of(1.0)
    step = plan_each(_TinyLM(p), options, {"ids": ids, "labels": ids}, lambda plan: plan.func.__self__)
    joint = copy_module(step.joint)
    alias_identity_dropouts(joint)
    analyse = lambda **kw: joint_module.analyze(joint, step.num_fwd_outputs, whole_step=True, **kw)  # noqa: E731
    before = analyse()
    assert _rewrite_for_planning(joint, options)[0]
    run, runs, measure, asked = saves._run, [], joint_module.op_memory, []
    monkeypatch.setattr(saves, "_run", lambda n, rg: runs.append(n) or run(n, rg))
    monkeypatch.setattr(joint_module, "op_memory", lambda nodes, *a, **k: asked.append(len(nodes)) or measure(nodes, *a, **k))
    reused = analyse(earlier=before)
    reused_runs, reused_asked = len(runs), sum(asked)
    fresh = analyse()
    assert reused.graph.nodes == fresh.graph.nodes and reused.fingerprint == fresh.fingerprint
    assert (reused.names, reused.codecs.keys()) == (fresh.names, fresh.codecs.keys())
    assert len(runs) > reused_runs
    if p is None:  # (the loss's backward only: one node replaced, its users read it)
        assert reused_runs == 0
        assert 0 < reused_asked < (sum(asked) - reused_asked) // 4  # (7 of 54 here: the in-place node, its readers)
