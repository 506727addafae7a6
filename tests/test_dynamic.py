"""Dynamic shapes: sizes as expressions, one plan (or one per bucket) for a range of shapes, the
largest batch that fits, and the errors (docs/dynamic-shapes.md)."""

from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.nn as nn

import fxopt
from fxopt.analysis.scratch import SCRATCH_MARGIN
from fxopt.analysis.symbolic import Evaluator, Ranges, monotone, simplify_on, symbol
from fxopt.capture.shapes import DynamicDims
from fxopt.models import GPT, ResidualMLP, SmallCNN
from helpers import assert_same_step, measured_peak, step

batch, seq = symbol("batch"), symbol("seq")
RANGES = Ranges({"batch": (1, 32), "seq": (2, 512)})


@pytest.mark.parametrize("size, ok", [
    (2048 * batch * seq, True),
    (64 * batch * seq**2 + 4 * seq, True),
    (8 * seq * (batch - 1) + 8 * seq, True),  # a storage's bytes as Dynamo writes them
    (batch * seq - 3 * seq, False),  # shrinks as seq grows while batch < 3
    (batch * seq - seq, True),  # batch >= 1
    (sympy.floor((seq - 1) / 2) + 1, True),
    (batch * sympy.Max(1, seq) + seq - sympy.Max(1, seq), True),  # Max(1, seq) is seq over the range
    (sympy.Max(seq - 600, 1) * batch, True),
    (-batch, False),
    (sympy.Mod(seq, 7), False),
    (512, True),
])
def test_monotone_is_checked_not_assumed(size, ok):
    assert monotone(size, RANGES).ok is ok


def test_sizes_evaluate_and_simplify_on_the_ranges():
    from torch.utils._sympy.functions import FloorDiv, Max

    assert simplify_on(batch * Max(1, seq) + seq - Max(1, seq), RANGES) == batch * seq
    at = Evaluator({"batch": 8, "seq": 128})
    assert at(2048 * batch * seq) == 2048 * 8 * 128 and at(FloorDiv(seq - 1, 2) + 1) == 64 and at(7) == 7
    with pytest.raises(fxopt.CaptureError, match="needs a value for"):
        Evaluator({"batch": 8})(batch * seq)


def test_a_size_that_is_not_monotone_is_an_error_naming_the_value():
    from fxopt.analysis import CostModel
    from fxopt.analysis.symbolic import NodeSizes, SymbolicGraph
    from fxopt.solvers.graph import Graph, Node

    graph = Graph((Node("x", "input", bytes=1), Node("odd", "forward", inputs=(0,), bytes=1)))
    sizes = (NodeSizes(bytes=4 * batch), NodeSizes(bytes=batch * seq - 3 * seq))
    symbolic = SymbolicGraph(graph, sizes, RANGES, {"batch": 32, "seq": 512}, CostModel())
    with pytest.raises(fxopt.CaptureError, match=r"odd's bytes .* is not non-decreasing"):
        symbolic.check_monotone()
    SymbolicGraph(graph, (sizes[0], NodeSizes(bytes=batch * seq)), RANGES, {}, CostModel()).check_monotone()
    at = symbolic.at({"batch": 2, "seq": 10})
    assert [n.bytes for n in at.nodes] == [8, 2 * 10 - 30] and at.nodes[1].name == "odd"


@pytest.mark.parametrize("dynamic, error", [
    ({"batch": None}, "has no range"),
    ({"batch": 32}, "has no range"),
    ({"batch": (4, 2)}, "1 <= lo <= hi"),
    ({"batch": (0, 2)}, "1 <= lo <= hi"),
    ({"width": (1, 2)}, "fxopt knows 'batch'"),
    ({("x", 1.5): (1, 2)}, "keys are"),
    ({}, "dict of dimension names"),
])
def test_bad_dynamic_specs_are_refused(dynamic, error):
    with pytest.raises((ValueError, TypeError), match=error):
        fxopt.optimize(ResidualMLP(2, 16), 0.5, dynamic=dynamic)


def test_named_dims_and_argument_dims():
    x, y, labels = torch.zeros(4, 10, 3), torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
    dims = DynamicDims.parse({"batch": (1, 8), "seq": (2, 16)})
    found = dims.dims(nn.Identity(), (x, y), {"labels": labels})
    assert sorted((t.shape, d, n) for t, d, n in found) == sorted(
        [(x.shape, 0, "batch"), (y.shape, 0, "batch"), (labels.shape, 0, "batch"), (x.shape, 1, "seq"),
         (y.shape, 1, "seq")])
    assert dims.point(found) == {"batch": 4, "seq": 10}
    by_arg = DynamicDims.parse({(0, -1): (1, 8)}).dims(nn.Identity(), (x,), {})
    assert [(d, n) for _, d, n in by_arg] == [(2, "0_m1")]
    with pytest.raises(ValueError, match="differ in this call"):
        dims.point(dims.dims(nn.Identity(), (x, torch.zeros(5, 10)), {}))


def _gpt():
    torch.manual_seed(0)
    return GPT(layers=2, dim=32, heads=2, vocab=128, max_seq=128, dropout=0.1).train()


@pytest.mark.slow
def test_one_capture_per_bucket_trains_like_eager_within_the_budget():
    """A GPT-2-style model with dropout, trained on batches of distinct sequence lengths: one
    capture and one plan per bucket, every step's gradients equal to eager's (same dropout masks)
    and its measured peak within the budget."""
    model = _gpt()
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), "3MiB", dynamic={"batch": (1, 4), "seq": (2, 128)},
                               time_limit=2.0)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(optimized.parameters(), lr=0.1)
    lengths = [128, 97, 40, 7, 2]
    g = torch.Generator().manual_seed(1)
    for step_no, length in enumerate(lengths):
        batch_size = 4 if step_no % 3 else 3
        ids = torch.randint(0, 128, (batch_size, length), generator=g)
        inputs = (ids, torch.roll(ids, -1, dims=1))
        torch.manual_seed(step_no)
        loss_e = step(eager, inputs)
        torch.manual_seed(step_no)
        measured = fxopt.measure_peak(step, optimized, inputs, resident=[optimized, inputs])
        assert_same_step(eager, optimized, loss_e, measured.result)
        assert measured.peak_bytes <= optimized.plan.budget_bytes, (batch_size, length)
        opt_e.step(), opt_o.step(), opt_e.zero_grad(), opt_o.zero_grad()
    state = optimized._dynamic.state
    buckets = optimized.buckets
    assert 1 <= len(buckets) <= 4 and buckets[0].ranges.bounds["seq"][0] == 2
    assert buckets[-1].ranges.bounds["seq"][1] == 128 and buckets[-1].plan.recompute_cost > 0
    touched = {fxopt.buckets.bucket_of(buckets, {"batch": 4, "seq": n}) for n in lengths}
    assert state.captures == len(touched)  # one capture per bucket used, none per shape
    assert state.plans <= len(buckets)
    for b in buckets:
        assert b.plan.peak_bytes <= b.plan.budget_bytes
    with pytest.raises(ValueError, match="outside the ranges"):
        optimized(torch.zeros(2, 200, dtype=torch.long), torch.zeros(2, 200, dtype=torch.long))


@pytest.mark.slow
def test_planned_from_example_inputs_then_run_at_other_shapes():
    torch.manual_seed(0)
    model = ResidualMLP(3, 32)
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(model, 0.8, dynamic={"batch": (1, 512)}, example_inputs=(torch.randn(8, 32),))
    assert optimized.buckets and optimized.plan.budget_bytes < optimized.plan.eager_peak_bytes
    for b in (512, 3, 200):
        x = torch.randn(b, 32)
        eager.zero_grad(), optimized.zero_grad()
        assert_same_step(eager, optimized, step(eager, (x,)), step(optimized, (x,)))
    touched = {fxopt.buckets.bucket_of(optimized.buckets, {"batch": b}) for b in (512, 3, 200)}
    assert optimized._dynamic.state.captures == 1 + len(touched)  # the planning capture, then one per bucket
    # The argument for one plan per range, on the simulator itself: the top bucket's schedule,
    # the eager schedule and the peak lower bound all peak no higher at a smaller batch.
    from fxopt.plan_ahead import capture_symbolic
    from fxopt.solvers import eager_schedule, simulate
    from fxopt.solvers.instant import peak_lower_bound

    model.zero_grad(set_to_none=True)  # (as when the plans were made: held gradients would count)
    _, jg = capture_symbolic(model, (torch.randn(8, 32),), DynamicDims.parse({"batch": (1, 512)}), {"batch": 8})
    top = optimized.buckets[-1]
    lo = top.ranges.bounds["batch"][0]
    for at_batch in ([lo, lo + 1, (lo + 512) // 2, 511, 512], [1, 2, 9, 64, 511, 512]):
        graphs = [jg.symbolic.at({"batch": b}) for b in at_batch]
        for schedule in ([top.plan.schedule] if at_batch[0] == lo else []) + [eager_schedule(jg.graph)]:
            peaks = [simulate(g, schedule).peak_bytes for g in graphs]
            assert peaks == sorted(peaks)
        bounds = [peak_lower_bound(g)[0] for g in graphs]
        assert bounds == sorted(bounds)
    assert simulate(jg.at({"batch": 512}), top.plan.schedule).peak_bytes <= top.plan.budget_bytes


@pytest.mark.slow
def test_a_size_that_specializes_is_refused_with_its_line():
    model = _gpt()
    ids = torch.zeros(2, 16, dtype=torch.long)
    optimized = fxopt.optimize(model, "3MiB", dynamic={"batch": (1, 4), "seq": (1, 128)})
    with pytest.raises(fxopt.CaptureError, match=r"Ne\(seq, 1\).*seq in \(2, 128\).*scaled_dot_product_attention"):
        optimized(ids, ids)

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x.view(16, 8)).sum()

    with pytest.raises(fxopt.CaptureError, match=r"specializes 'batch'.*x.view\(16, 8\)"):
        fxopt.optimize(Fixed(), 0.9, dynamic={"batch": (1, 64)})(torch.randn(16, 8))


@pytest.mark.slow
def test_a_range_the_budget_cannot_hold_names_what_fits():
    torch.manual_seed(0)
    model = GPT(layers=1, dim=16, heads=2, vocab=64, max_seq=128, dropout=0.0)
    ids = torch.zeros(4, 128, dtype=torch.long)
    dynamic = {"batch": (1, 4), "seq": (2, 128)}
    with pytest.raises(fxopt.InfeasibleBudgetError, match=r"seq up to \d+ fit one plan: narrow the range to \(2, \d+\)"):
        fxopt.optimize(model, "300KiB", dynamic=dynamic, example_inputs=(ids, ids), time_limit=1.0)
    with pytest.raises(fxopt.InfeasibleBudgetError, match="Even batch=4, seq=2 does not fit"):
        fxopt.optimize(model, "20KiB", dynamic=dynamic, example_inputs=(ids, ids), time_limit=1.0)


MAX_BATCH_MODELS = {  # (model, inputs at batch b, budget, the largest batch searched)
    "residual_mlp": (lambda: ResidualMLP(3, 64), lambda b: (torch.randn(b, 64),), "2MiB", 4096),
    "cnn": (lambda: SmallCNN(8), lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))), "3MiB", 256),
    "transformer": (lambda: GPT(2, 32, 2, 128, 64, dropout=0.0),
                    lambda b: (torch.randint(0, 128, (b, 64)), torch.randint(0, 128, (b, 64))), "3MiB", 256),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MAX_BATCH_MODELS)
def test_max_batch_fits_and_the_next_does_not(name):
    """The batch found runs within the budget, measured (its plan, at that batch and a smaller
    one); the next is proven out of reach, or fxopt's lowest-peak plan there measures over it."""
    build, make_inputs, budget, limit = MAX_BATCH_MODELS[name]
    torch.manual_seed(0)
    model = build()
    found = fxopt.max_batch(model, budget, make_inputs, limit=limit)
    assert found.batch < limit and not found.stopped  # (counted work decided it, not the safety stop)
    b = found.batch
    assert 1 <= b <= found.proven_max and found.eager_batch <= b
    assert found.checkpoint_batch is None or found.checkpoint_batch <= b
    assert found.plan.peak_bytes <= found.budget_bytes
    optimized = found.optimize(model)
    for batch_size in (b, max(found.captured[0], b // 2)):
        torch.manual_seed(0)
        assert measured_peak(optimized, make_inputs(batch_size)) <= found.budget_bytes, batch_size
    if b == found.proven_max:
        assert found.next_plan is None
        return
    assert found.next_plan.peak_bytes > found.budget_bytes
    lowest = fxopt.maxbatch.replay(model, found, found.next_plan, (b + 1, b + 1))
    torch.manual_seed(0)
    # The next batch's lowest plan really needs about the budget: its measured peak is above it,
    # or below it by no more than the margin fxopt adds to one op's measured scratch (an op's
    # kernel allocates a few bytes more or less on another CPU: 56 B on this machine's conv).
    assert measured_peak(lowest, make_inputs(b + 1)) > found.budget_bytes - SCRATCH_MARGIN


def test_max_batch_needs_bytes():
    with pytest.raises(fxopt.BudgetError, match="in bytes"):
        fxopt.max_batch(ResidualMLP(2, 16), 0.5, lambda b: (torch.randn(b, 16),))


# ------------------------------------------------------------------ max_batch: options in, the clock out
def _tiny_max_batch(**options):
    """`max_batch` of a two-block residual MLP at 96 KiB: the bracket's lowest peak is over the
    budget, so the bisection solves (the smallest search that reaches every kind of solve)."""
    torch.manual_seed(0)
    return fxopt.max_batch(ResidualMLP(2, 16), "96KiB", lambda b: (torch.randn(b, 16),), limit=400, **options)


def test_max_batch_makes_each_batchs_graph_once_where_planning_rewrites_nothing(monkeypatch):
    """Without ReLU masks (``compress=False``) the residual MLP's step planning starts from is the
    step as captured: one graph, whose graph at each batch the eager, per-block checkpointing and
    fxopt bisections all read, made once (issue 27: one search for each, not two)."""
    from fxopt.analysis import JointGraph

    made = []
    at = JointGraph.at
    monkeypatch.setattr(JointGraph, "at", lambda jg, point: made.append((id(jg), *point.items())) or at(jg, point))
    found = _tiny_max_batch(compress=False, time_limit=1e6)
    assert found.plan.peak_bytes <= found.budget_bytes and found.eager_batch <= found.batch
    assert len(set(made)) == len(made) > 1


def test_max_batch_asks_its_brackets_where_their_bounds_meet_the_budget(monkeypatch):
    """Each bracket (the peak lower bound with zero scratch, then with the scratch measured) is
    asked first at the batch where its bound, growing as from the range's two smallest batches,
    meets the budget (`fxopt.buckets.largest_near`): fewer bounds than the searches up from the
    bottom (issue 27: fewer graphs made at batches nothing else reads), the same answer."""
    import fxopt.maxbatch as maxbatch
    from fxopt.buckets import largest, largest_from_below

    bounds = []
    real = maxbatch.peak_lower_bound
    monkeypatch.setattr(maxbatch, "peak_lower_bound", lambda graph: bounds.append(len(graph)) or real(graph))
    guessed = _tiny_max_batch(compress=False, time_limit=1e6)
    asked = len(bounds)
    bounds.clear()
    with monkeypatch.context() as patched:  # the searches before: the zero-scratch one up from the bottom
        patched.setattr(maxbatch._Search, "guess", lambda search, bound, hi, bottom_first=False: search.lo)
        patched.setattr(maxbatch, "largest_near", lambda lo, hi, fits, guess: (
            largest_from_below if fits.__name__ == "lower_bound_fits" else largest)(lo, hi, fits))
        plain = _tiny_max_batch(compress=False, time_limit=1e6)
    answer = [(f.batch, f.proven_max, f.eager_batch, f.checkpoint_batch, _decisions(f.plan), _decisions(f.next_plan))
              for f in (guessed, plain)]
    assert answer[0] == answer[1]
    assert asked < len(bounds), (asked, len(bounds))


def _decisions(plan):
    return None if plan is None else (plan.schedule, plan.peak_bytes, plan.recompute_cost, plan.solver, plan.status,
                                      plan.lower_bound_cost, plan.budget_bytes)


@pytest.mark.slow
def test_max_batch_gives_every_solve_its_options(monkeypatch):
    """Every solve and lowest-peak search `max_batch` runs gets the options' solver, effort and MIP
    program, and one safety stop of ``time_limit`` shared by all; ``effort`` also scales the
    bisection (half the effort: at most half the solves)."""
    import fxopt.maxbatch as maxbatch
    from fxopt.solvers import DEFAULT_EFFORT
    from fxopt.solvers.effort import Deadline

    calls: list[tuple[str, tuple, dict]] = []

    def recorded(name, real):
        def call(graph, *args, **kwargs):
            calls.append((name, args, kwargs))
            return real(graph, *args, **kwargs)
        return call

    for name in ("solve", "min_feasible_budget", "lowest_schedule"):
        monkeypatch.setattr(maxbatch, name, recorded(name, getattr(maxbatch, name)))
    found = _tiny_max_batch(solver="ilp", effort=0.5, mip_solver="highs", time_limit=1e6)
    assert found.options.effort == 0.5 and found.options.mip_solver == "highs" and not found.stopped
    assert {name for name, _, _ in calls} == {"solve", "min_feasible_budget", "lowest_schedule"}
    for name, args, kwargs in calls:
        solver = args[1] if name == "solve" else args[0]
        assert (solver, kwargs["effort"], kwargs["mip_solver"]) == ("ilp", DEFAULT_EFFORT.scaled(0.5), "highs"), name
    solves = [c for c in calls if c[0] == "solve"]
    # (The bisection, from the batch the lowest-peak schedule fits to the bracket, needs more.)
    assert len(solves) == round(maxbatch.BISECTION_SOLVES * 0.5)
    deadlines = {id(kwargs["time_limit"]) for _, _, kwargs in calls}
    assert len(deadlines) == 1 and isinstance(calls[0][2]["time_limit"], Deadline)
    assert calls[0][2]["time_limit"].seconds == 1e6


@pytest.mark.slow
def test_max_batch_does_not_depend_on_how_fast_the_clock_runs(monkeypatch):
    """The same model and options give the same answer (batch, bracket, plans) with every Python
    clock running 30 times fast (a machine 30 times slower, to every limit `max_batch` and its
    solves could read) and 30 times slow: counted effort decides, and the safety stop, far above
    what the search takes, is reached by no run."""
    from clocks import every_clock

    quiet = _tiny_max_batch(time_limit=1e6)
    for factor in (30.0, 1 / 30):
        every_clock(monkeypatch, factor)
        other = _tiny_max_batch(time_limit=1e6)
        monkeypatch.undo()
        assert not quiet.stopped and not other.stopped, factor
        assert ((quiet.batch, quiet.proven_max, quiet.eager_batch, quiet.checkpoint_batch)
                == (other.batch, other.proven_max, other.eager_batch, other.checkpoint_batch)), factor
        assert _decisions(quiet.plan) == _decisions(other.plan), factor
        assert _decisions(quiet.next_plan) == _decisions(other.next_plan), factor


def test_max_batch_time_limit_is_a_safety_stop_that_says_so(monkeypatch):
    """With the clock far past the time limit, `max_batch` still answers, with a plan within the
    budget, and says it stopped (`MaxBatch.stopped`, one `SolverTimeoutWarning`, the summary)."""
    from clocks import every_clock
    from fxopt.solvers import SolverTimeoutWarning

    every_clock(monkeypatch, 1e4)
    with pytest.warns(SolverTimeoutWarning, match="max_batch stopped at the time limit") as warned:
        found = _tiny_max_batch(time_limit=1.0)
    monkeypatch.undo()
    stops = [w for w in warned if issubclass(w.category, SolverTimeoutWarning)]  # (others may come too)
    assert len(stops) == 1
    assert found.stopped and all(phase in str(stops[0].message) for phase in found.stopped)
    assert found.plan.peak_bytes <= found.budget_bytes and found.batch <= found.proven_max
    assert "stopped at the time limit" in found.summary()
