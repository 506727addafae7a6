"""What fxopt's eager compiler costs beside the step it runs (issue 28): its bookkeeping at each
call is counted in Python calls, not timed, so the tests do not depend on the machine's speed."""

import ctypes
import pickle
import sys

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.capture.opcalls import direct_call


class Nest(nn.Module):
    """``inner`` behind one more level of modules."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def nested(depth: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    for _ in range(depth):
        model = Nest(model)
    return model


def python_calls(fn) -> int:
    """Python function calls (generator resumptions too) while ``fn()`` runs."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def warmed(model: nn.Module, optimizing: nn.Module | None = None):
    """``fxopt.optimize(optimizing)`` at 1.0 and its step (a sum of its output, backward), run
    twice; by default ``optimizing`` is ``model``, else a wrapper of it (a DDP)."""
    optimized = fxopt.optimize(model if optimizing is None else optimizing, 1.0)
    x = torch.randn(4, 8)

    def step():
        optimized(x).sum().backward()

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step()
    return optimized, step


def step_calls(model: nn.Module, optimizing: nn.Module | None = None) -> int:
    """Python calls of one step of ``fxopt.optimize(optimizing)`` at 1.0, after two steps
    (`warmed`)."""
    _, step = warmed(model, optimizing)
    model.zero_grad(set_to_none=True)  # (torch's walk: not counted)
    return python_calls(step)


def test_a_call_costs_no_python_per_level_of_modules():
    """Each call walks the model's parameters and buffers (what is resident, which gradients are
    already there): torch's walk resumes a generator per level of nesting for every module it
    yields, four walks a call. Before: 791 Python calls a call at 1 level, 6,091 at 41 (and on a
    small transformers ResNet of 89 modules, 9,050 a step against torch.compile's aot_eager's
    1,010; 2,014 now)."""
    shallow, deep = step_calls(nested(1)), step_calls(nested(41))
    assert deep - shallow < 100, (shallow, deep)


class Broken(nn.Module):
    """Two linears with a graph break between them (``.item()`` steering Python)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > -1e9:
            h = h * 1.0
        return self.b(h)


def counted_work(monkeypatch) -> tuple[list, list, list]:
    """While the test runs: the `fxopt.capture.pieces.Step` of each call, the number of tensors
    each storages walk of `fxopt.capture.pieces` covers, and each entry of fxopt's settings for Dynamo."""
    from fxopt.capture import compiled, pieces
    from fxopt.storage import tensors_in

    steps, walked, settings = [], [], []
    start, storages, dynamo_settings = pieces.Step.start, pieces.storages, compiled.dynamo_settings

    def counted_start(cls, *args, **kwargs):
        steps.append(start(*args, **kwargs))
        return steps[-1]

    def counted_storages(obj, **kwargs):
        walked.append(len(tensors_in(obj, grads=kwargs.get("grads", False))))
        return storages(obj, **kwargs)

    monkeypatch.setattr(pieces.Step, "start", classmethod(counted_start))
    monkeypatch.setattr(pieces, "storages", counted_storages)
    monkeypatch.setattr(compiled, "dynamo_settings", lambda *a: settings.append(1) or dynamo_settings(*a))
    return steps, walked, settings


def test_a_one_graph_step_reads_nothing_resident_after_its_first_call(monkeypatch):
    """Issue 28: a step captured as one graph has no reserve to count, so a call after the first
    walks none of the model's storages (what is resident, which gradients are there, the graph's
    inputs: three walks over the parameters a call before), and does not enter fxopt's settings
    for Dynamo (read only when Dynamo compiles, `fxopt.capture.compiled`). On a bench ViT under
    Inductor the two were 0.35 ms a step, the step 1.04x torch.compile's. Counted, not timed: if
    the fast path stops being taken, this fails. A new shape still compiles within the settings,
    and a step in pieces still reads what is resident for its reserves."""
    model = nested(1)
    optimized, step = warmed(model)
    x = torch.randn(4, 8)
    steps, walked, settings = counted_work(monkeypatch)
    model.zero_grad(set_to_none=True)
    step()
    assert len(steps) == 1 and not steps[0].resident_read, steps
    n_params = len(list(model.parameters()))
    assert sum(walked) < n_params, walked  # (the graph's output alone)
    assert settings == []

    model.zero_grad(set_to_none=True)
    optimized(torch.randn(6, 8)).sum().backward()  # (a new shape: Dynamo compiles it)
    assert settings and len(optimized.plans) == 2
    steps[:], settings[:] = [], []
    model.zero_grad(set_to_none=True)
    optimized(torch.randn(6, 8)).sum().backward()  # (the call after a compile runs within them)
    model.zero_grad(set_to_none=True)
    optimized(torch.randn(6, 8)).sum().backward()
    assert len(settings) == 1 and not any(s.resident_read for s in steps)

    torch.manual_seed(0)
    broken = fxopt.optimize(Broken(), 10**8)
    with pytest.warns(fxopt.GraphBreakWarning):
        broken(x).sum().backward()
    steps[:] = []
    broken.zero_grad(set_to_none=True)
    broken(x).sum().backward()
    assert len(steps) == 1 and steps[0].resident_read and len(steps[0].pieces) == 2


def dict_versions(model: nn.Module) -> list[int] | None:
    """The version tag of each module's ``__dict__``: CPython moves it at every write to the
    dictionary, and Dynamo's guards on a module's attributes read it to skip what did not change
    (torch 2.11's recursive dict tags). None where this Python's dictionaries do not carry one
    where CPython 3.11-3.13 keep it (after the object header and ``ma_used``)."""
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    offset = 2 * ctypes.sizeof(ctypes.c_void_p) + ctypes.sizeof(ctypes.c_ssize_t)
    return [ctypes.c_uint64.from_address(id(m.__dict__) + offset).value for m in model.modules()]


def frames_in(fn, where: str, called_from: tuple[str, ...] = ("",)) -> list[str]:
    """The names of the Python functions called while ``fn()`` runs whose file's path contains
    ``where``, called from a file whose path contains one of ``called_from``."""
    names = []

    def profile(frame, event, arg):
        if event == "call" and where in frame.f_code.co_filename.replace("\\", "/"):
            caller = frame.f_back.f_code.co_filename.replace("\\", "/") if frame.f_back is not None else ""
            if any(c in caller for c in called_from):
                names.append(f"{frame.f_code.co_name} {frame.f_code.co_filename}:{frame.f_code.co_firstlineno}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def test_a_cached_one_graph_step_runs_no_python_around_its_graph(monkeypatch):
    """Issue 28: a call of a step captured whole, whose graph Dynamo has cached, enters no context
    manager of its own (fxopt's settings for Dynamo, planning's clock, the dispatch modes' pass, the
    routes of DDP and FSDP2: none needed) nor of ``torch.compile(model)``'s ``OptimizedModule``,
    writes no module's ``__dict__`` (the model's ``forward`` was set and deleted at every call:
    Dynamo's guards on the model then saw a changed dictionary), walks no autograd graph (every
    node the call made was made in the graph, `Step.check_covered`), and meets no frame Dynamo
    compiles. Counted: before (at f5fc281), on this model, a step made 18 calls of contextlib's
    from fxopt's code and the ``OptimizedModule``'s, and 82 of fxopt's own (31 now: the fxopt
    module's forward, its walk of the model, the step's record, the eager compiler's code); a ViT
    under Inductor made 1,105 Python calls a step against plain torch.compile's 973."""
    from fxopt.capture import coverage

    model = nested(1)
    optimized, step = warmed(model)
    compiled = optimized._steps[0][1]
    walks = []
    monkeypatch.setattr(coverage, "nodes_made_since", lambda *a: walks.append(1) or iter(()))
    model.zero_grad(set_to_none=True)
    before = dict_versions(model)
    step()
    assert before is None or dict_versions(model) == before
    assert walks == [] and not compiled.met_frames
    # (Under a profile function Dynamo's frame callback is entered, unseen by it, so the call after
    # a profiled one runs inside fxopt's settings for Dynamo: an unprofiled call before each.)
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    assert frames_in(step, "/contextlib.py", called_from=("/fxopt/", "torch/_dynamo/eval_frame.py")) == []
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    own = frames_in(step, "/fxopt/")
    assert len(own) <= 32, "\n".join(own)


class Doubled(nn.Module):
    """``nested(1)`` under a user's module whose forward prints."""

    def __init__(self):
        super().__init__()
        self.inner = nested(1)

    def forward(self, x):
        print("in forward")
        return self.inner(x) * 2


@pytest.mark.parametrize("make", [Doubled, lambda: nested(0)], ids=["user", "torch.nn"])
def test_the_step_starts_at_a_frame_of_its_own(make, monkeypatch, capsys):
    """Dynamo starts the step at the model's copied ``forward`` (a user's module: its ``print``
    still runs at every call), or at a frame of fxopt's around it (torch's own modules, whose
    frames torch.compile would enter through ``external_utils.inner``, a wrapper every such
    compile shares), never at a frame another compile shares."""
    from fxopt.capture import pieces

    started = []
    compiling_code = pieces.compiling_code
    monkeypatch.setattr(pieces, "compiling_code", lambda: started.append(compiling_code()) or started[-1])
    model = make()
    optimized = fxopt.optimize(model, 1.0)
    x = torch.randn(4, 8)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        optimized(x).sum().backward()
    compiled = optimized._steps[0][1]
    assert started and all(code in compiled.entry_codes for code in started), started
    assert not any("external_utils" in code.co_filename for code in started)
    assert capsys.readouterr().out.count("in forward") == (3 if isinstance(model, Doubled) else 0)


def test_hooks_on_the_model_run_as_nn_module_runs_them():
    """A step compiles the model's ``forward`` itself, so a call runs the model's hooks through
    ``nn.Module.__call__`` where it has some (added at any time, or global), outside the graph as
    ``torch.compile(model)`` runs them: the model's own with the same graph (nothing recompiled;
    a global hook applies to the submodules inside the graph too, which Dynamo traces anew), the
    model's ``__dict__`` as before after the call. A hook that computes is outside the plan: refused."""
    model = nested(1)
    optimized = fxopt.optimize(model, 1.0)
    x = torch.randn(4, 8)

    def step():
        model.zero_grad(set_to_none=True)
        optimized(x).sum().backward()

    step()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    keys = set(model.__dict__)
    step()
    assert seen == ["pre"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert set(model.__dict__) == keys
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append("global") if module is model else None)
    try:
        step()
    finally:
        handle.remove()
    assert seen == ["pre", "pre", "global"]

    computing = nested(1)
    computing.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(fxopt.CaptureError, match="MulBackward0"):
        fxopt.optimize(computing, 1.0)(x).sum().backward()


def test_module_tensors_are_torchs():
    from fxopt.storage import module_tensors

    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.BatchNorm1d(4), nn.Sequential(shared, nn.Linear(4, 4)))
    model[2][1].weight = model[0].weight  # a tied weight under another module's name
    model.register_buffer("none_buffer", None)
    model.add_module("none_module", None)
    model[1].register_parameter("none_param", None)

    params, buffers = module_tensors(model)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers()]
    named = module_tensors(model, remove_duplicate=False)[0]
    assert [id(p) for p in named] == [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    assert len(named) > len(params)


def aten_graph():
    """A small aten graph (as AOTAutograd gives the eager compiler) and its inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return (torch.nn.functional.gelu(x @ w) * x).sum(0)

    torch.manual_seed(0)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    return make_fx(f)(x, w), (x, w)


# Where this torch's `OpOverload.__call__` does more than call ``_op`` (torch 2.14 first checks for a
# Python-object dispatcher), every op is called as FX writes it (`fxopt.capture.opcalls.direct_call`).
CALLS_BUILTINS = pytest.mark.skipif(
    direct_call(torch.ops.aten.mm.default) is None,
    reason=f"torch {torch.__version__}'s OpOverload.__call__ does more than call _op: ops are called as FX writes them")


@CALLS_BUILTINS
def test_the_eager_compilers_code_calls_each_ops_builtin():
    """Issue 28: each aten op is called through its builtin (`fxopt.capture.opcalls`), not through
    ``torch.ops...`` and `OpOverload.__call__`: one Python call fewer per op, the same bits."""
    from fxopt.capture.dynamo import _boxed

    gm, inputs = aten_graph()
    expected = gm(*inputs)
    ops = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    plain = python_calls(lambda: gm(*inputs))  # FX's code: torch.ops.aten.<op>.<overload>(...)
    run = _boxed(gm, inputs)
    body = gm.code.split("def forward")[1]  # (before it: each builtin bound, by the op's name)
    assert "torch.ops.aten" not in body and "aten_mul_Tensor(" in body, gm.code
    for n in ops:
        assert n.target._op in gm.forward.__globals__.values()
    assert all(isinstance(n.target, torch._ops.OpOverload) for n in ops)  # (the graph is unchanged)
    assert torch.equal(run(list(inputs)), expected)
    pickle.dumps(gm)  # (as FX's own code does: the builtins are bound by the code, not passed in)
    direct = python_calls(lambda: run(list(inputs)))
    assert plain - direct >= len(ops) - 2, (plain, direct, len(ops))  # (run's own frame and its list)


@CALLS_BUILTINS
def test_an_op_called_otherwise_is_called_as_fx_writes_it(monkeypatch):
    """Where an op's ``_op`` is not a builtin (or is missing: another torch), the code calls the op
    as FX writes it, and the op runs as before."""
    from fxopt.capture.dynamo import _boxed

    gm, inputs = aten_graph()
    expected = gm(*inputs)
    mul, calls = torch.ops.aten.mul.Tensor, []
    builtin = mul._op

    def counted(*args, **kwargs):
        calls.append(1)
        return builtin(*args, **kwargs)

    monkeypatch.setattr(mul, "_op", counted)
    run = _boxed(gm, inputs)
    assert "torch.ops.aten.mul.Tensor(" in gm.code and "aten_mm_default(" in gm.code, gm.code
    assert torch.equal(run(list(inputs)), expected) and calls == [1]

    monkeypatch.setattr(mul, "_op", None)  # (missing, as far as the code is concerned)
    gm.recompile()
    assert "torch.ops.aten.mul.Tensor(" in gm.code and "aten_mm_default(" in gm.code, gm.code
    monkeypatch.setattr(mul, "_op", builtin)

    # A torch whose OpOverload.__call__ does more than call ``_op``: every op is called through it.
    def call(self, /, *args, **kwargs):
        calls.append(self)
        return self._op(*args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", call)
    gm, inputs = aten_graph()
    run, calls[:] = _boxed(gm, inputs), []
    assert "torch.ops.aten.mul.Tensor(" in gm.code and "torch.ops.aten.mm.default(" in gm.code, gm.code
    assert "._op" not in gm.code
    assert torch.equal(run(list(inputs)), expected)
    assert len(calls) == sum(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
