"""The public API: budgets, errors, plans, re-planning and the module contract."""

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.analysis import CostModel
from fxopt.budget import Budget
from fxopt.models import residual_mlp
from fxopt.solvers import SOLVERS
from helpers import assert_same_step, count_analyses, masked_mlp, run_pair, step


def small():
    torch.manual_seed(0)
    return residual_mlp(blocks=3, width=64, batch=2048)


@pytest.mark.parametrize(
    "budget, expected",
    [(1000, 1000), ("3GiB", 3 * 2**30), ("500MB", 500 * 10**6), ("1.5 KiB", 1536), ("512M", 512 * 2**20),
     (0.5, 500), ("50%", 500), (1.0, 1000)],
)
def test_budget_forms(budget, expected):
    assert Budget.parse(budget).resolve(eager_peak_bytes=1000) == expected


def test_a_budget_is_parsed_once_into_the_options():
    options = fxopt.Options(budget="50%")
    assert options.budget == Budget(fraction=0.5) and str(options.budget) == "50%"
    assert fxopt.Options(budget=" min ").budget == Budget(minimum=True)
    assert fxopt.Options(budget="3GiB").budget.bytes == 3 * 2**30
    assert fxopt.Options(budget=options.budget).budget is options.budget


@pytest.mark.parametrize("budget", [0, -5, "3 potatoes", "", 1.5, 0.0, float("nan"), True, None, "-3GiB", [1],
                                    "150%", "0%", "1e400GiB"])
def test_bad_budgets_are_refused_early(budget):
    model, inputs = small()
    with pytest.raises(fxopt.BudgetError) as info:
        fxopt.optimize(model, budget)
    assert "budget" in str(info.value)
    with pytest.raises(fxopt.BudgetError):
        fxopt.plan(model, budget, inputs)


@pytest.mark.parametrize("budget, says, not_says", [
    ("-1GiB", "must be positive", "cannot read"),
    (-5, "must be positive", "cannot read"),
    ("0%", "must be positive", "cannot read"),
    ("150%", "'150%' is more than the eager peak", "1.5"),
    ("3 potatoes", "cannot read budget '3 potatoes'", "positive"),
])
def test_budget_errors_say_what_is_wrong_in_the_users_words(budget, says, not_says):
    """Issue 24, item 12: "-1GiB" said "cannot read budget", "150%" spoke of a float 1.5."""
    with pytest.raises(fxopt.BudgetError) as info:
        Budget.parse(budget)
    assert says in str(info.value) and not_says not in str(info.value)


@pytest.mark.slow
def test_min_plans_the_smallest_budget_fxopt_meets_in_one_call():
    """``"min"``: what a user asks for after an `InfeasibleBudgetError`, in one call: the plan is
    within the budget fxopt names as the smallest, and a budget just below it is infeasible."""
    model, inputs = small()
    plan = fxopt.plan(model, "min", inputs, time_limit=10)
    assert plan.peak_bytes <= plan.budget_bytes < plan.eager_peak_bytes
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, plan.budget_bytes - 1, inputs, time_limit=10)
    assert info.value.min_budget == plan.budget_bytes
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, "min", time_limit=10)
    assert_same_step(eager, optimized, loss_e, loss_o)
    assert optimized.plan.budget_bytes == plan.budget_bytes
    # Another input shape is planned at its own minimum (the plan made from the examples does not fit).
    optimized.zero_grad(set_to_none=True)
    step(optimized, (inputs[0][:512],))
    smaller = optimized.plans[-1]
    assert smaller.peak_bytes <= smaller.budget_bytes < plan.budget_bytes
    assert smaller.budget_bytes == fxopt.plan(model, "min", (inputs[0][:512],), time_limit=10).budget_bytes


@pytest.mark.parametrize("relu", [False, True])
def test_min_analyses_the_step_as_often_as_any_budget(monkeypatch, relu):
    """``"min"`` searches its smallest budget on the step the planner analysed, not on a copy
    analysed again (issue 27: the analysis of a 32-layer step is seconds): the analysis runs as
    often as for a budget in bytes (with ReLU masks, twice more: the search at one byte analyses
    the step without them, and planning at the minimum starts with them again; a copy analysed
    again made it 2 and 3 more), and the plan is the one a budget in bytes at that minimum gives."""
    model, inputs = masked_mlp(relu)
    calls = count_analyses(monkeypatch)
    least = fxopt.plan(model, "min", inputs, compress=relu)  # (ReLU masks with compress=True)
    at_min = len(calls)
    calls.clear()
    again = fxopt.plan(model, least.budget_bytes, inputs, compress=relu)
    assert at_min == len(calls) + 2 * relu
    assert least.peak_bytes <= least.budget_bytes and again.budget_bytes == least.budget_bytes
    assert again.recomputed == least.recomputed and again.peak_bytes == least.peak_bytes
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, least.budget_bytes - 1, inputs, compress=relu)
    assert info.value.min_budget == least.budget_bytes


@pytest.mark.slow
def test_one_options_value_is_taken_by_every_entry_point():
    """`fxopt.Options` as is, or its fields by keyword (issue 25, "one option schema")."""
    model, inputs = small()
    options = fxopt.Options(budget=0.8, solver="greedy", time_limit=10)
    plan = fxopt.plan(model, options, inputs)
    assert plan.solver == "greedy" and plan.budget_bytes == int(0.8 * plan.eager_peak_bytes)
    assert fxopt.plan(model, options, inputs, solver="checkpoint").solver == "checkpoint"
    module = fxopt.optimize(model, options)
    assert module._options is options
    assert fxopt.backend(options).options is options
    assert fxopt.backend(0.8).options.compiler == "inductor"  # the backend's own default
    with pytest.raises(ValueError, match="unknown fxopt option.*'sovler'.*the options are budget, solver"):
        fxopt.plan(model, 0.8, inputs, sovler="greedy")
    with pytest.raises(ValueError, match="unknown fxopt option.*'in_flight'"):
        fxopt.optimize(model, 0.8, in_flight=None)  # set by fxopt's own entry points only
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.solver = "ilp"


@pytest.mark.parametrize("field, value, error, message", [
    ("solver", "magic", ValueError, "unknown solver 'magic'"),
    ("compiler", "tvm", ValueError, "unknown compiler 'tvm'"),
    ("time_limit", 0, ValueError, "time_limit must be a positive number"),
    ("compress", "yes", TypeError, "compress must be a bool"),
    ("quantize", "int3", ValueError, "unknown quantize format"),
    ("offload", "50%", fxopt.BudgetError, "not a fraction"),
    ("offload", 1.5, TypeError, "offload must be"),
    ("cost_model", 1e9, TypeError, "cost_model must be a CostModel"),
    ("plan", "no/such/plan.json", FileNotFoundError, "plan.json"),
    ("mip_solver", "gurobi", ValueError, "unknown mip_solver 'gurobi'; choose one of highs, cbc"),
])
def test_each_option_is_checked_when_the_options_are_made(field, value, error, message):
    with pytest.raises(error, match=message):
        fxopt.Options(budget="1GiB", **{field: value})


def test_the_mip_program_reaches_every_solve_and_keys_the_plan(monkeypatch):
    """``mip_solver``, one field of `fxopt.Options`: every solve of the step gets it, and a plan
    made with another MIP program is another cache entry (its memo key too: test_solvers)."""
    import fxopt.planner as planner

    seen = []
    real_solve = planner.solve
    monkeypatch.setattr(planner, "solve", lambda *a, **k: seen.append(k["mip_solver"]) or real_solve(*a, **k))
    model, inputs = small()
    fxopt.plan(model, 0.7, inputs, solver="greedy", mip_solver="cbc")
    assert seen and set(seen) == {"cbc"}
    keys = {fxopt.Options(budget=0.7, mip_solver=m).solver_key() for m in (None, "highs", "cbc")}
    assert len(keys) == 3


def test_the_options_normalise_what_they_are_given(tmp_path):
    model, inputs = small()
    plan = fxopt.plan(model, 0.9, inputs, solver="greedy")
    plan.to_json(tmp_path / "plan.json")
    options = fxopt.Options(budget="1GiB", offload="2GiB", quantize="int8", plan=str(tmp_path / "plan.json"),
                            time_limit=3)
    assert options.offload == options.host_budget == 2 * 2**30
    assert options.quantize == fxopt.Quantize("int8") and options.plan.schedule == plan.schedule
    assert options.time_limit == 3.0 and isinstance(options.time_limit, float)


def meta_llama_like():
    with torch.device("meta"):
        return residual_mlp(blocks=2, width=64, batch=16)[0]


def test_a_model_on_the_meta_device_is_refused_with_what_to_do():
    """Issue 24, item 5: a model built under ``torch.device("meta")`` was planned silently wrong
    (scratch memory unmeasured, a smallest budget below its own parameters)."""
    model = meta_llama_like()
    x = torch.randn(16, 64, device="meta")
    for call in (lambda: fxopt.plan(model, 0.5, (x,)), lambda: fxopt.optimize(model, 0.5, example_inputs=(x,)),
                 lambda: fxopt.optimize(model, "1MiB")(x)):
        with pytest.raises(fxopt.CaptureError, match=r"meta device.*to_empty\(device='cpu'\)"):
            call()
    real, inputs = small()
    with pytest.raises(fxopt.CaptureError, match="example inputs are on the meta device"):
        fxopt.plan(real, 0.5, (inputs[0].to("meta"),))


def test_a_step_with_meta_inputs_is_refused_by_the_planner():
    """The backend sees no model, only the captured graph: the planner refuses its meta inputs
    (parameters included)."""
    compiled = torch.compile(meta_llama_like(), backend=fxopt.backend(0.5, compiler="eager"))
    with pytest.raises(Exception, match="captured step's inputs .* are on the meta device"):  # (as Dynamo wraps it)
        compiled(torch.randn(16, 64, device="meta"))


@pytest.mark.slow
def test_infeasible_budget_names_the_minimum():
    model, inputs = small()
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 1000, inputs)
    err = info.value
    assert err.budget == 1000 and err.min_budget > 1000
    assert "smallest feasible budget" in str(err) and str(err.min_budget) in str(err)
    plan = fxopt.plan(model, err.min_budget, inputs)
    assert plan.peak_bytes <= err.min_budget
    with pytest.raises(fxopt.InfeasibleBudgetError):
        fxopt.plan(model, err.min_budget - 1024, inputs)


def test_plan_fields_and_json_round_trip(tmp_path):
    model, inputs = small()
    plan = fxopt.plan(model, 0.7, inputs)
    assert plan.budget_bytes == int(0.7 * plan.eager_peak_bytes)
    assert plan.peak_bytes <= plan.budget_bytes < plan.eager_peak_bytes
    assert plan.recompute_flops > 0 and plan.recomputed and plan.saved
    assert plan.status in ("optimal", "feasible", "heuristic") and plan.solve_seconds > 0
    assert set(plan.decisions().values()) == {"SAVE", "RECOMPUTE"}
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = fxopt.Plan.from_json(path)
    assert again.to_dict() == plan.to_dict()
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, 0.7)
    replayed = fxopt.optimize(copy.deepcopy(model), 0.7, plan=again)
    loss_r = step(replayed, inputs)
    assert_same_step(eager, replayed, loss_e, loss_r)
    assert replayed.plan is again


def test_plan_for_another_shape_is_refused():
    model, inputs = small()
    plan = fxopt.plan(model, 0.8, inputs)
    optimized = fxopt.optimize(model, 0.8, plan=plan)
    with pytest.raises(fxopt.CaptureError, match="different graph"):
        optimized(torch.randn(1024, 64))


def test_plans_at_first_call_and_replans_for_new_shapes():
    model, inputs = small()
    optimized = fxopt.optimize(copy.deepcopy(model), 0.8)
    assert optimized.plan is None
    step(optimized, inputs)
    assert len(optimized.plans) == 1
    optimized.zero_grad()
    step(optimized, inputs)
    assert len(optimized.plans) == 1  # same shape: no re-plan
    optimized.zero_grad()
    step(optimized, (torch.randn(1024, 64),))
    assert len(optimized.plans) == 2
    assert optimized.plans[1].eager_peak_bytes < optimized.plans[0].eager_peak_bytes


def test_a_plan_made_from_example_inputs_is_replanned_for_a_new_shape():
    model, inputs = small()
    optimized = fxopt.optimize(copy.deepcopy(model), 0.8, example_inputs=inputs)
    first = optimized.plan
    step(optimized, inputs)
    assert optimized.plan is first  # the example plan fits: replayed, not made again
    step(optimized, (torch.randn(1024, 64),))  # another shape: planned anew, not refused
    assert optimized.plan is not first
    assert optimized.plan.eager_peak_bytes < first.eager_peak_bytes
    assert optimized.plan.budget_bytes == int(0.8 * optimized.plan.eager_peak_bytes)


def test_module_contract():
    model, inputs = small()
    optimized = fxopt.optimize(model, 0.8, example_inputs=inputs)
    assert list(optimized.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(optimized.parameters(), model.parameters()))
    optimizer = torch.optim.SGD(optimized.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step(optimized, inputs)
    optimizer.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    optimized.eval()
    assert not model.training
    optimized.train()
    assert model.training
    assert optimized.blocks is model.blocks  # attributes of the original are reachable
    import inspect

    assert inspect.signature(optimized.forward) == inspect.signature(model.forward)  # for code that reads it
    twin = copy.deepcopy(optimized)  # a copy runs its own model, not the original's
    twin.zero_grad(), optimized.zero_grad()
    step(twin, inputs)
    assert all(p.grad is None for p in model.parameters()) and all(p.grad is not None for p in twin.parameters())


def test_graph_break_is_refused_with_the_reason():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            y = self.l(x)
            if y.sum().item() > 0:  # data-dependent control flow: Dynamo must break the graph
                y = y * 2
            return y

    optimized = fxopt.optimize(DataDependent(), 0.9, graph_breaks="error")
    with pytest.raises(fxopt.CaptureError, match="whole training step as one graph"):
        optimized(torch.randn(4, 8))
    with pytest.raises(fxopt.CaptureError, match="graph_breaks='split'"):
        fxopt.plan(DataDependent(), 0.9, (torch.randn(4, 8),))


def test_wrong_arguments():
    model, inputs = small()
    with pytest.raises(TypeError, match="nn.Module"):
        fxopt.optimize(lambda x: x, 0.5)
    with pytest.raises(ValueError, match="unknown solver"):
        fxopt.optimize(model, 0.5, solver="magic")


def test_no_backward_is_reported():
    model, inputs = small()
    model.requires_grad_(False)
    with pytest.raises(fxopt.CaptureError, match="no backward"):
        fxopt.plan(model, 0.5, inputs)


@pytest.mark.parametrize("solver", ["save_all", "checkpoint", "greedy", "ilp", "auto"])
def test_every_solver_end_to_end(solver):
    model, inputs = small()
    budget = 1.0 if solver == "save_all" else 0.8
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, solver=solver, time_limit=20)
    assert_same_step(eager, optimized, loss_e, loss_o)
    if solver == "auto":  # the cheapest plan of any of them
        assert optimized.plan.solver.split("+")[0] in {*SOLVERS, "ilp-rounding"} - {"auto"}
    else:
        assert optimized.plan.solver == solver
    assert optimized.plan.peak_bytes <= optimized.plan.budget_bytes


def test_plans_are_cached_on_disk(tmp_path, monkeypatch):
    """The second plan of the same step at the same budget comes from the cache (no solve), and
    equals the first; another budget is solved again; FXOPT_CACHE=0 turns the cache off."""
    import fxopt.planner as capture
    from fxopt.models import ZOO

    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    solves = []
    real_solve = capture.solve
    monkeypatch.setattr(capture, "solve", lambda *a, **k: solves.append(1) or real_solve(*a, **k))
    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    first = fxopt.plan(model, 0.7, inputs, solver="greedy")
    again = fxopt.plan(model, 0.7, inputs, solver="greedy")
    assert len(solves) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    assert again.to_dict() == first.to_dict()
    fxopt.plan(model, 0.8, inputs, solver="greedy")
    assert len(solves) == 2
    monkeypatch.setenv("FXOPT_CACHE", "0")
    fxopt.plan(model, 0.7, inputs, solver="greedy")
    assert len(solves) == 3


@pytest.mark.slow
def test_infeasible_names_a_floor_and_a_minimum_that_plans(monkeypatch):
    """"Infeasible" names a proven floor under the minimum; a budget between the two is answered
    the same way (or planned within it); and that minimum plans, in a process that did not search
    (the planner's memo of lowest peaks cleared, the plan cache off), and the same plan again."""
    from fxopt import cache
    from fxopt.models import ZOO

    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 1, inputs)
    err = info.value
    assert err.lower_bound is not None and 1 < err.lower_bound <= err.min_budget
    between = (err.lower_bound + err.min_budget) // 2
    if err.lower_bound < between < err.min_budget:
        with pytest.raises(fxopt.InfeasibleBudgetError) as again:
            fxopt.plan(model, between, inputs)
        assert (again.value.min_budget, again.value.lower_bound) == (err.min_budget, err.lower_bound)
    cache.lowest_peaks.clear()  # as in a new process
    plan = fxopt.plan(model, err.min_budget, inputs)
    assert plan.peak_bytes <= err.min_budget
    cache.lowest_peaks.clear()
    again = fxopt.plan(model, err.min_budget, inputs)
    assert {**again.to_dict(), "solve_seconds": 0} == {**plan.to_dict(), "solve_seconds": 0}


def test_a_damaged_or_unwritable_plan_cache_only_costs_a_solve(tmp_path, monkeypatch):
    """A cache entry that cannot be read is solved again and replaced; a cache directory that
    cannot be made (a file is in its way) caches nothing and plans all the same."""
    import fxopt.planner as planner

    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    solves = []
    real_solve = planner.solve
    monkeypatch.setattr(planner, "solve", lambda *a, **k: solves.append(1) or real_solve(*a, **k))
    model, inputs = small()
    first = fxopt.plan(model, 0.7, inputs, solver="greedy")
    per_plan = len(solves)  # two if greedy misses with ReLU masks and plans without them
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(entry.read_text()[:100])  # cut short
    again = fxopt.plan(model, 0.7, inputs, solver="greedy")
    assert len(solves) == 2 * per_plan
    assert (again.schedule, again.peak_bytes) == (first.schedule, first.peak_bytes)
    assert fxopt.Plan.from_json(entry).to_dict() == again.to_dict()  # the entry is whole again
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(blocked / "plans"))
    again = fxopt.plan(model, 0.7, inputs, solver="greedy")
    assert len(solves) == 3 * per_plan and again.schedule == first.schedule


def _has_relu_masks(graph) -> bool:
    return any(n.name.startswith("where") for n in graph.nodes)  # ReLU's backward reading a mask


def test_relu_masks_never_make_a_budget_infeasible(monkeypatch):
    """When no plan of the step with ReLU's backward reading bool masks fits, the step is planned
    as captured before the budget is called infeasible, and that plan replays; when neither fits,
    the error names the smaller of the two smallest budgets."""
    import fxopt.planner as planner

    real_solve = planner.solve
    graphs = []

    def misses_with_masks(graph, budget, *args, **kwargs):
        graphs.append(graph)
        if _has_relu_masks(graph):
            raise fxopt.InfeasibleBudgetError(budget, 10**12)
        return real_solve(graph, budget, *args, **kwargs)

    monkeypatch.setattr(planner, "solve", misses_with_masks)
    model, inputs = small()
    plan = fxopt.plan(model, 0.7, inputs, solver="greedy")
    masks = [_has_relu_masks(g) for g in graphs]  # (with them: the step, then without its codecs)
    assert masks[0] and not masks[-1] and masks == sorted(masks, reverse=True)
    assert not _has_relu_masks(plan.graph) and plan.peak_bytes <= plan.budget_bytes
    eager = copy.deepcopy(model)
    replayed = fxopt.optimize(copy.deepcopy(model), 0.7, plan=plan)
    assert_same_step(eager, replayed, step(eager, inputs), step(replayed, inputs))

    def never_fits(graph, budget, *args, **kwargs):
        raise fxopt.InfeasibleBudgetError(budget, 5 * 10**6 if _has_relu_masks(graph) else 6 * 10**6)

    monkeypatch.setattr(planner, "solve", never_fits)
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 0.7, inputs, solver="greedy")
    assert info.value.min_budget == 5 * 10**6


def test_relu_masks_below_the_floor_without_them_are_not_searched_again(monkeypatch):
    """A budget out of reach with the ReLU masks, whose smallest budget with them is below the
    step's floor without them, is answered at once: nothing is solved or searched without them."""
    import fxopt.planner as planner

    real_solve, calls = planner.solve, []

    def with_masks_only(graph, budget, *args, **kwargs):
        calls.append(_has_relu_masks(graph))
        if _has_relu_masks(graph):
            raise fxopt.InfeasibleBudgetError(budget, 1000, lower_bound=900)
        return real_solve(graph, budget, *args, **kwargs)

    monkeypatch.setattr(planner, "solve", with_masks_only)
    model, inputs = small()
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 1, inputs, solver="greedy")
    assert calls == [True]
    assert (info.value.min_budget, info.value.lower_bound) == (1000, 900)


def test_the_time_limit_counts_capture(monkeypatch, caplog):
    """`time_limit` bounds the answer with capture included: the solvers get what capture left of
    it, and at least half of it however long capture took."""
    import time

    import fxopt.planner as planner

    limits = []
    real_solve = planner.solve
    monkeypatch.setattr(planner, "solve", lambda *a, **k: limits.append(k["time_limit"].seconds) or real_solve(*a, **k))
    model, inputs = small()
    started = time.perf_counter()
    fxopt.plan(model, 0.7, inputs, solver="greedy", time_limit=30.0)
    captured = time.perf_counter() - started
    assert limits and all(30.0 - captured <= t < 30.0 for t in limits), (limits, captured)
    options = planner.Options(budget=0.5, time_limit=4.0)
    assert planner.solve_seconds(options) == 4.0  # no call capturing: the limit is the solvers'
    with planner.capture_clock():
        planner._CAPTURE_STARTED.set(planner.now() - 60)  # a capture of a minute (CPU)
        with caplog.at_level(logging.WARNING, logger="fxopt"):
            assert planner.solve_seconds(options) == 4.0 * planner.MIN_SOLVE_SHARE
            assert planner.solve_seconds(options) == 4.0 * planner.MIN_SOLVE_SHARE  # (a second piece)
    said = [r.getMessage() for r in caplog.records if "capturing the step took" in r.getMessage()]
    assert len(said) == 1 and "device='cpu'" in said[0] and "time_limit=4 s" in said[0], said  # once, with what to do


def test_cost_model_prices_every_node():
    """A node costs FLOPs / flops_per_second + bytes moved / bytes_per_second + op_overhead (a
    tenth of it for an alias): a machine half as fast in every respect doubles every cost and
    the plan's, and changes no decision."""
    assert CostModel(1e9, 1e8, 1e-6).seconds(2 * 10**9, 10**8, is_alias=False) == pytest.approx(3 + 1e-6)
    assert CostModel(op_overhead=1e-5).seconds(10**9, 10**9, is_alias=True) == pytest.approx(1e-6)
    model, inputs = small()
    fast = fxopt.plan(model, 0.7, inputs, solver="greedy")
    slow = fxopt.plan(model, 0.7, inputs, solver="greedy", cost_model=CostModel(5e10, 5e9, 4e-6))
    assert fast.recompute_cost > 0
    assert slow.schedule == fast.schedule
    assert slow.recompute_cost == pytest.approx(2 * fast.recompute_cost)
    assert [n.cost for n in slow.graph.nodes] == pytest.approx([2 * n.cost for n in fast.graph.nodes])


def test_a_step_does_not_simulate_its_plan_at_every_call(monkeypatch):
    """The plan's timeline (what a step in pieces reads of it at every call) is simulated once per
    plan: simulating it at every call cost 5 ms of a test-size GPT-2's 10 ms step (issue 28)."""
    from fxopt.solvers import plan as plan_module

    torch.manual_seed(0)
    model, inputs = residual_mlp(blocks=2, width=32, batch=256)
    optimized = fxopt.optimize(model, 1.0, example_inputs=inputs)
    step(optimized, inputs)
    calls = []
    simulate = plan_module.simulate
    monkeypatch.setattr(plan_module, "simulate", lambda *args, **kw: calls.append(1) or simulate(*args, **kw))
    for _ in range(3):
        optimized.zero_grad(set_to_none=True)
        step(optimized, inputs)
    assert calls == []
