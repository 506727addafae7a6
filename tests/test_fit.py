"""`fxopt.fit` and ``fxopt fit``: does a step fit a device, planned on fake tensors for its profile.
Each answer is checked against the entry point it comes from (`fxopt.plan` at "min" and at the
budget, `fxopt.max_batch`) and against the others (floor <= smallest budget <= a budget that fits;
the largest batch at least the example's where the example fits)."""

import copy
import json
import logging

import pytest
import torch

import fxopt
from fxopt import devices
from fxopt.cli.main import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, main
from fxopt.models import gpt2
from helpers import count_analyses, masked_mlp

TIME_LIMIT = 60
FELL_BACK = "no plan fits with ReLU masks"
SHAPE = dict(layers=2, dim=64, heads=4, seq=64, batch=4, vocab=512)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return gpt2(**SHAPE)


@pytest.mark.slow
def test_fit_at_the_devices_memory_and_at_a_tight_budget(tiny):
    model, inputs = tiny
    roomy = fxopt.fit(model, inputs, device="H100-80GB", time_limit=TIME_LIMIT, limit=64)
    assert roomy.budget_bytes == devices.load("H100-80GB").memory_bytes and not roomy.budget_given
    assert roomy.fits and roomy.eager_peak_bytes <= roomy.budget_bytes
    assert roomy.floor_bytes <= roomy.min_budget_bytes <= roomy.plan.peak_bytes <= roomy.budget_bytes
    assert roomy.largest.batch == 64 and roomy.batch == 4  # (the search limit)
    torch._dynamo.reset()
    alone = fxopt.plan(model, "min", inputs, device="H100-80GB", time_limit=TIME_LIMIT)
    assert alone.budget_bytes == roomy.min_budget_bytes and alone.eager_peak_bytes == roomy.eager_peak_bytes

    tight = (roomy.min_budget_bytes + roomy.eager_peak_bytes) // 2  # below eager, above fxopt's smallest
    torch._dynamo.reset()
    found = fxopt.fit(model, inputs, device="H100-80GB", budget=tight, time_limit=TIME_LIMIT, limit=64)
    assert found.budget_given and found.fits and found.plan.peak_bytes <= tight < found.eager_peak_bytes
    assert found.largest.eager_batch < found.batch <= found.largest.batch <= found.largest.proven_max
    assert found.largest.plan.peak_bytes <= tight and "planned for H100-80GB" in found.largest.plan.planned_for
    text = str(found)
    assert "planned for H100-80GB on fake tensors" in text and "formula bound" in text and "over" in text
    assert json.loads(json.dumps(found.to_dict()))["fits"] is True


@pytest.mark.slow
def test_a_budget_below_the_smallest_does_not_fit_and_says_what_it_needs(tiny):
    model, inputs = tiny
    found = fxopt.fit(model, inputs, device="H100-80GB", budget="1MiB", time_limit=TIME_LIMIT, limit=64)
    assert not found.fits and found.plan is None and found.largest is None and "batch" in found.largest_error
    assert found.min_budget_bytes > 1 << 20  # (the cuBLAS workspace alone is 32 MiB)
    assert "does not fit: needs at least" in str(found)


@pytest.mark.slow
def test_fit_refuses_what_it_cannot_answer(tiny):
    model, inputs = tiny
    with pytest.raises(fxopt.BudgetError, match="no fixed memory: give fit a budget"):
        fxopt.fit(model, inputs, device="cpu")
    with pytest.raises(fxopt.BudgetError, match="in bytes or as a size"):
        fxopt.fit(model, inputs, device="H100-80GB", budget=0.5)
    with pytest.raises(ValueError, match="leave plan= out"):
        fxopt.fit(model, inputs, device="H100-80GB", plan=fxopt.plan(model, 0.5, inputs, device="cpu"))
    with pytest.raises(ValueError, match="unknown fxopt option"):
        fxopt.fit(model, inputs, device="H100-80GB", budgets="1GiB")


@pytest.mark.slow
def test_fxopt_fit_on_the_command_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_gpt.py").write_text(
        "import torch\nfrom fxopt.models import gpt2\n\n"
        f"def model():\n    torch.manual_seed(0)\n    return gpt2(**{SHAPE!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["fit", "tiny_gpt:model"]) == EXIT_USAGE
    assert "--device is required" in capsys.readouterr().err
    assert main(["fit", "tiny_gpt:model", "--device", "H100-80GB", "--budget", "50%"]) == EXIT_USAGE
    out = tmp_path / "fit.json"
    assert main(["fit", "tiny_gpt:model", "--device", "H100-80GB", "--limit", "16", "--json", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "does it fit on H100-80GB?" in printed and "smallest budget fxopt reaches" in printed
    assert json.loads(out.read_text())["largest_batch"] == 16
    assert main(["fit", "tiny_gpt:model", "--device", "H100-80GB", "--budget", "1MiB"]) == EXIT_INFEASIBLE


@pytest.mark.slow
def test_fxopt_inspect_plans_for_a_cuda_profile_and_refuses_to_run_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_gpt.py").write_text(
        "import torch\nfrom fxopt.models import gpt2\n\n"
        f"def model():\n    torch.manual_seed(0)\n    return gpt2(**{SHAPE!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "tiny_gpt:model", "--device", "H100-80GB", "--budget", "min"]) == EXIT_OK
    assert "planned for H100-80GB on fake tensors" in capsys.readouterr().out
    assert main(["inspect", "tiny_gpt:model", "--device", "H100-80GB", "--run"]) == EXIT_USAGE
    assert "--run measures the plan on this machine" in capsys.readouterr().err


@pytest.mark.slow
def test_below_the_batches_max_batch_searched_the_examples_own_answer_stands(tiny):
    """A capture with the batch symbolic sets a batch of 1 apart (`MaxBatch.captured` starts at
    2): where only batch 1 fits, max_batch finds nothing in its range, and the example's own
    plan (at batch 1) is the answer, said as such, not "0"."""
    import dataclasses

    model, inputs = tiny
    found = dataclasses.replace(fxopt.fit(model, inputs, device="H100-80GB", budget="64MiB", time_limit=TIME_LIMIT,
                                          limit=8), batch=1)
    assert found.fits
    none_above = dataclasses.replace(found.largest, eager_batch=0, checkpoint_batch=0, captured=(2, 8))
    row = dict(dataclasses.replace(found, largest=none_above).rows())["largest batch"]
    assert "eager 1 (the example's; none from 2 up)" in row and "per-block checkpointing none from 2 up" in row
    assert "batches from 2 searched" in row
    failed = dict(dataclasses.replace(found, largest=None, largest_error="fxopt found no plan at any batch from 2 up.").rows())
    assert failed["largest batch"].startswith("fxopt 1, the example's (planned above)")
    assert "fxopt found no plan at any batch from 2 up." in failed["largest batch"]


@pytest.mark.slow
def test_fit_plans_both_budgets_from_one_capture(tiny, monkeypatch):
    """The smallest budget and the budget are planned from one capture of the step (each on its
    own copy of it): two captures in all with the largest batch's, not three; and the two plans
    are those `fxopt.plan` makes alone, decision for decision."""
    import fxopt.plan_ahead

    model, inputs = tiny
    captures = []
    compile_step = fxopt.plan_ahead.compile_step
    monkeypatch.setattr(fxopt.plan_ahead, "compile_step", lambda *a, **k: captures.append(a) or compile_step(*a, **k))
    budget = 64 << 20
    found = fxopt.fit(model, inputs, device="H100-80GB", budget=budget, time_limit=TIME_LIMIT, limit=8)
    assert len(captures) == 2 and found.fits and set(found.seconds) >= {"capture", "smallest budget"}
    monkeypatch.undo()

    def decisions(plan):
        return {k: v for k, v in plan.to_dict().items() if k != "solve_seconds"}

    for asked, planned in (("min", found.min_plan), (budget, found.plan)):
        torch._dynamo.reset()
        alone = fxopt.plan(model, asked, inputs, device="H100-80GB", time_limit=TIME_LIMIT)
        assert decisions(alone) == decisions(planned)


@pytest.mark.parametrize("relu", [False, True])
def test_fit_analyses_each_graph_of_its_plans_once(monkeypatch, caplog, relu):
    """fit's two plans (the smallest budget, then the budget: here that smallest, so that with
    ReLU masks the plan at it tries them, then falls back to the step without them, as a fresh
    plan does) analyse the graphs of their one capture no more often than the plan at "min" alone
    (issue 27: each analysis of a real-size step is seconds; each plan analysed its copy again),
    and are the plans `fxopt.plan` makes alone, decision for decision."""
    import fxopt.fitting

    model, inputs = masked_mlp(relu)
    calls, planned = count_analyses(monkeypatch), []
    caplog.set_level(logging.INFO, logger="fxopt")
    least = fxopt.plan(model, "min", inputs, device="H100-80GB", time_limit=TIME_LIMIT)
    alone, fell_back = len(calls), caplog.text.count(FELL_BACK)
    calls.clear()
    caplog.clear()
    max_batch = fxopt.fitting.max_batch
    monkeypatch.setattr(fxopt.fitting, "max_batch", lambda *a, **k: planned.append(len(calls)) or max_batch(*a, **k))
    torch._dynamo.reset()
    found = fxopt.fit(model, inputs, device="H100-80GB", budget=least.budget_bytes, time_limit=TIME_LIMIT, limit=512)
    assert planned == [alone] and found.fits and found.min_budget_bytes == least.budget_bytes
    assert caplog.text.count(FELL_BACK) == fell_back + relu == 3 * relu  # (the plan at it fell back too)
    monkeypatch.undo()

    def decisions(plan):
        return {k: v for k, v in plan.to_dict().items() if k != "solve_seconds"}

    torch._dynamo.reset()
    at_budget = fxopt.plan(model, least.budget_bytes, inputs, device="H100-80GB", time_limit=TIME_LIMIT)
    assert decisions(found.min_plan) == decisions(least) and decisions(found.plan) == decisions(at_budget)


# max_batch's searches at each budget: (budget, the calls of its solves and lowest-peak searches)
SEARCHES = [
    # The bracket's lowest peak fits: one search, one solve.
    ("64MiB", ["min_feasible_budget", "solve"]),
    # It does not: its schedule replayed one batch down fits, which is planned without searching
    # again; the lowest-peak plan at the bracket (`next_plan`) is the search's, kept.
    ("128MiB", ["min_feasible_budget", "lowest_schedule", "solve", "lowest_schedule"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("budget,searches", SEARCHES)
def test_the_largest_batch_is_bracketed_by_the_bound_with_scratch_before_any_search(tiny, monkeypatch, budget,
                                                                                     searches):
    """Below the zero-scratch bracket, the peak lower bound with each batch's scratch (here the
    profile's formula, 2 x the logits' bytes and more) proves most batches out of reach, one bound
    each: max_batch then runs one lowest-peak search, at that bracket, and solves the batch it
    answers (issue 27: it ran three searches at 64 MiB, two of them at batches no schedule fits;
    and searched again at a batch a replayed schedule was known to fit)."""
    import fxopt.maxbatch as maxbatch

    model, inputs = tiny
    calls = []
    for name in ("solve", "min_feasible_budget", "lowest_schedule"):
        real = getattr(maxbatch, name)
        monkeypatch.setattr(maxbatch, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    found = fxopt.fit(model, inputs, device="H100-80GB", budget=budget, time_limit=TIME_LIMIT, limit=512)
    largest = found.largest
    assert calls == searches and not largest.stopped
    assert largest.plan.peak_bytes <= largest.budget_bytes
    assert largest.eager_batch <= largest.checkpoint_batch <= largest.batch <= largest.proven_max
    if largest.batch == largest.proven_max:
        assert largest.next_plan is None
    else:
        assert largest.next_plan.peak_bytes > largest.budget_bytes


def test_the_scratch_formula_read_once_gives_each_batchs_as_read_anew(tiny):
    """`JointGraph.at` reads the scratch formula's sizes of a symbolic step once
    (`fxopt.analysis.scratch.FormulaMemory`) for every batch it is asked for: each batch's
    answer is the formula read node by node at that batch, and the graph the same as from a
    copy of the step that read nothing before."""
    import dataclasses
    import operator

    from fxopt.analysis.scratch import OpMemory, _ALIASES_ON_CUDA, _outs, outputs_only_on_cuda
    from fxopt.capture.shapes import DynamicDims
    from fxopt.fitting import at_batch
    from fxopt.fxgraph import aliases_input
    from fxopt.options import Options
    from fxopt.plan_ahead import capture_symbolic
    from fxopt.storage import tensors_in

    model, inputs = tiny
    profile = devices.load("H100-80GB")
    dims = DynamicDims.parse({"batch": (1, 64)})
    _, jg = capture_symbolic(model, at_batch(inputs, 4), dims, {"batch": 4}, Options.of(1 << 40, device=profile))
    lo, _ = jg.symbolic.ranges.bounds["batch"]
    fx_nodes, formula = jg._ops
    assert formula is not None

    def read_anew(at) -> dict:
        """The formula as it was read before: every node's fake values walked at each batch."""
        out = {}
        for n in fx_nodes:
            if n.op != "call_function" or n.target is operator.getitem \
                    or not isinstance(n.target, torch._ops.OpOverload) or n.target._schema.is_mutable \
                    or not _outs(n) or any(at(o.numel()) == 0 for o in _outs(n)) \
                    or isinstance(n.meta.get("val"), torch.Tensor) and aliases_input(n.target):
                continue
            outputs = sum(at(t.numel()) * t.element_size() for t in _outs(n))
            if n.target in _ALIASES_ON_CUDA:
                out[n] = OpMemory(0)
            elif outputs_only_on_cuda(n):
                out[n] = OpMemory(outputs)
            else:
                ins = sum(at(t.numel()) * t.element_size() for a in n.all_input_nodes for t in tensors_in(a.meta.get("val")))
                out[n] = OpMemory(outputs + round(profile.scratch_factor * (ins + outputs)))
        return out

    from fxopt.analysis.symbolic import Sizes
    for b in (lo + 5, lo, 64, lo + 1):
        sizes = Sizes(jg.symbolic.names, {"batch": b}, jg.symbolic.ranges)
        assert formula.at(sizes.at) == read_anew(sizes.at)
        assert jg.at({"batch": b}).nodes == dataclasses.replace(jg).at({"batch": b}).nodes


def test_the_symbolic_captures_planned_step_reads_the_captured_ones_analysis(tiny, monkeypatch):
    """max_batch's capture analyses the step as captured and as rewritten for planning (the loss's
    backward written in place). The second reads what the rewrite left alone from the first, as
    `fxopt.planner.make_plan` does (issue 27: on Llama-3-8B shapes each symbolic analysis took 2.8
    CPU seconds, most of it `eager_saves`, run twice): `eager_saves` runs once, not twice, and both
    graphs are, at every batch, those of two analyses made afresh (the step as captured read from a
    copy kept before the rewrite)."""
    import fxopt.analysis.joint as joint
    import fxopt.capture.dynamic
    import fxopt.planner as planner
    from fxopt.capture.shapes import DynamicDims
    from fxopt.fitting import at_batch
    from fxopt.fxgraph import copy_module
    from fxopt.options import Options
    from fxopt.plan_ahead import capture_symbolic

    model, inputs = tiny
    model = copy.deepcopy(model).eval()  # (no dropout: the loss's backward is the one rewrite, in the backward)
    options = Options.of(1 << 40, device=devices.load("H100-80GB"))
    dims = DynamicDims.parse({"batch": (1, 64)})
    runs = []
    eager_saves = joint.eager_saves
    monkeypatch.setattr(joint, "eager_saves", lambda *a, **k: runs.append(1) or eager_saves(*a, **k))

    def afresh(gm, num_fwd_outputs, options, unread_resident_bytes=0, sizes=None):
        """The analyses before the reuse: each graph analysed on its own."""
        codecs = planner._codecs(options, unread_resident_bytes, sizes)
        analyze = planner._analyzer(gm, options)
        planner.coalesce_all_reduces(gm)
        planner.alias_identity_dropouts(gm)
        eager = analyze(copy_module(gm), num_fwd_outputs, options.cost_model, **codecs)
        rewritten, _ = planner._rewrite_for_planning(gm, options)
        return eager, analyze(gm, num_fwd_outputs, options.cost_model, **codecs) if rewritten else eager

    found = capture_symbolic(model, at_batch(inputs, 4), dims, {"batch": 4}, options)
    assert len(runs) == 1 and found[0] is not found[1] and found[0].module is not found[1].module
    runs.clear()
    torch._dynamo.reset()
    with monkeypatch.context() as patched:
        patched.setattr(planner, "analyze_for_planning", afresh)
        patched.setattr(fxopt.plan_ahead, "analyze_for_planning", afresh)
        patched.setattr(fxopt.capture.dynamic, "analyze_for_planning", afresh)
        fresh = capture_symbolic(model, at_batch(inputs, 4), dims, {"batch": 4}, options)
    assert len(runs) == 2
    lo, hi = found[1].symbolic.ranges.bounds["batch"]
    for mine, theirs in zip(found, fresh):
        assert mine.names == theirs.names and mine.module_paths == theirs.module_paths
        for b in (lo, 5, hi):
            assert joint.graph_fingerprint(mine.at({"batch": b})) == joint.graph_fingerprint(theirs.at({"batch": b}))


@pytest.mark.parametrize("lo,hi", [(2, 8), (1, 1), (3, 40)])
def test_the_batch_searches_give_one_answer_and_count_their_questions(lo, hi):
    """`largest`, `largest_from_below` and `largest_from_above` give the same answer for every
    monotone question (fits up to some v, none, all); `largest_from_above` asks one question where
    the answer is the top (max_batch's replay of the lowest-peak schedule of the batch above: on
    Llama-3-8B it fits the batch below, one replay where the bisection made four)."""
    from fxopt.buckets import largest, largest_from_above, largest_from_below

    for v in range(lo - 1, hi + 1):
        asked = {search: [] for search in (largest, largest_from_below, largest_from_above)}
        answers = {search.__name__: search(lo, hi, lambda b, _a=asked[search]: _a.append(b) or b <= v)
                   for search in asked}
        assert set(answers.values()) == {v if v >= lo else None}, answers
        if v == hi:
            assert asked[largest_from_above] == [hi]
        assert all(len(set(a)) == len(a) for a in asked.values())  # (no batch asked twice)


@pytest.mark.parametrize("lo,hi", [(2, 8), (1, 1), (3, 40)])
def test_the_search_from_a_guess_gives_the_same_answer_and_asks_two_questions_at_it(lo, hi):
    """`largest_near` gives `largest`'s answer for every monotone question and every guess (in
    the range or out of it), asks no batch twice, and asks two questions where the guess is the
    answer below the top (`fxopt.max_batch`'s brackets, guessed from their bounds' growth at the
    top of the range)."""
    from fxopt.buckets import guessed, largest_near

    for v in range(lo - 1, hi + 1):
        for guess in range(lo - 2, hi + 3):
            asked = []
            found = largest_near(lo, hi, lambda b, _a=asked: _a.append(b) or b <= v, guess)
            assert found == (v if v >= lo else None), (v, guess, asked)
            assert len(set(asked)) == len(asked)
            if lo <= guess == v < hi:
                assert asked == [v, v + 1]
    # (a bound of 10 + 3 b meets a budget of 40 at b = 10; one within it at the top: the top; one
    # over it that does not grow there: the bottom)
    assert guessed(lo, hi, 10 + 3 * (hi - 1), 10 + 3 * hi, 40) == min(max(10, lo), hi)
    assert guessed(lo, hi, 10, 10, 40) == hi
    assert guessed(lo, hi, 50, 50, 40) == lo
