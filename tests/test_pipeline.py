"""`fxopt.pipeline` without processes: bad input refused before anything is captured or started,
module boundaries read from capture paths, and the plan's JSON. (Running plans on processes:
tests/test_pipeline_runtime.py; the cut solver itself: tests/test_stages.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.distributed.pipeline import module_of
from fxopt.models import GPT, gpt2_lm, lm_loss


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=4, microbatches=2), "Schedule1F1B needs at least as many microbatches as stages: 2 microbatches < 4"),
    (dict(stages=2, microbatches=3), "batch of 8 does not split into 3 equal microbatches"),
    (dict(stages=1, microbatches=2), "stages must be an int of at least 2"),
    (dict(stages=2, microbatches=2, schedule="ZeroBubble"), "unknown schedule 'ZeroBubble'"),
])
def test_refused_before_capture(kwargs, message, monkeypatch):
    import fxopt.distributed.pipeline

    def no_capture(*a, **k):
        raise AssertionError("captured")

    monkeypatch.setattr(fxopt.distributed.pipeline, "plan_and_rewrite", no_capture)
    model, (idx,) = gpt2_lm(layers=2, dim=16, heads=2, seq=8, batch=8, vocab=32)
    with pytest.raises(ValueError, match=message):
        fxopt.pipeline(model, (idx,), target=idx, loss_fn=lm_loss, budget=0.5, **kwargs)


def test_more_stages_than_cut_points():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"cannot be split into 8 stages; ask for at most [2-4] stages"):
        fxopt.pipeline(model, (torch.randn(8, 8),), stages=8, microbatches=8, budget=0.9)


def test_tied_embeddings_leave_nowhere_to_cut():
    torch.manual_seed(0)
    model = GPT(layers=2, dim=16, heads=2, vocab=32, max_seq=8, dropout=0.0)  # lm_head shares wte's weight
    idx = torch.randint(0, 32, (4, 8))
    # (Its one cut point is past the tied weight's last use, between the logits and the loss.)
    with pytest.raises(ValueError, match="1 place.*cannot be split into 3 stages.*tied"):
        fxopt.pipeline(model, (idx, idx), stages=3, microbatches=4, budget=0.9)


@pytest.mark.parametrize("path, within, expected", [
    ("L['self'].model.h.0.ln_1", "model", "h.0.ln_1"),
    ("L['self'].model", "model", ""),
    ("", "model", None),  # the loss, outside the model
    ("L['self'].model.h[3].attn", "model", "h.3.attn"),
    ("getattr(L.self.h, '3').ln_2", None, "h.3.ln_2"),
    ("L['self'].loss_fn", "model", None),
])
def test_module_of(path, within, expected):
    assert module_of(path, within) == expected


def test_every_stage_is_planned_with_the_options_given(monkeypatch):
    """The options reach every stage's plan (issue 25: a plain dict of three of them before, so
    quantize, offload and the compiler could not be set); unknown ones are refused."""
    import fxopt.distributed.pipeline
    from fxopt.analysis.codecs import Quantize

    import fxopt.capture.dynamo

    seen = []
    real = fxopt.capture.dynamo.make_plan  # (every plan, of a stage captured or planned from an earlier capture)
    monkeypatch.setattr(fxopt.capture.dynamo, "make_plan", lambda j, n, o, *a, **k: seen.append(o) or real(j, n, o, *a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inputs = (torch.randn(8, 8),)
    plan = fxopt.pipeline(model, inputs, stages=2, microbatches=2, budget=0.95, quantize="int8", compress=False,
                          solver="greedy", time_limit=2)
    stages = [o for o in seen if o.in_flight is not None]
    assert len(stages) >= 2 and len(plan.stages) == 2
    assert all(o.quantize == Quantize("int8") and o.compress is False and o.solver == "greedy" for o in stages)
    assert all(o.budget.bytes == plan.budget_bytes for o in stages)
    with pytest.raises(ValueError, match="unknown fxopt option.*'sovler'"):
        fxopt.pipeline(model, inputs, stages=2, microbatches=2, budget=0.9, sovler="greedy")


def test_forwards_run_for_their_shapes_run_on_one_thread():
    """The eager forwards `fxopt.pipeline` runs only for what they make (the model's output for
    the loss, each stage's output for the next stage's capture) run without autograd on one torch
    thread (on a busy machine torch's threads wait on each other at every small op); the threads
    torch was given are given back."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
            self.calls: list[int] = []

        def forward(self, x):
            if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
                self.calls.append(torch.get_num_threads())
            return self.net(x)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = Counted()
        fxopt.pipeline(model, (torch.randn(8, 8),), stages=2, microbatches=2, budget=0.95, solver="greedy")
        assert model.calls and set(model.calls) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("split_points", [None, [("2", "BEGINNING")]])
def test_min_plans_at_the_smallest_budget_an_infeasible_one_names(split_points):
    """``budget="min"`` (refused before: issue 24's "every named minimum plans", on the pipeline's
    route) plans at the per-device budget an infeasible budget names, every stage within it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    inputs = (torch.randn(32, 64),)
    kwargs = dict(stages=2, microbatches=2, solver="greedy", split_points=split_points)
    with pytest.raises(fxopt.InfeasibleBudgetError) as refused:
        fxopt.pipeline(model, inputs, budget=1, **kwargs)
    plan = fxopt.pipeline(model, inputs, budget="min", **kwargs)
    assert plan.budget_bytes == refused.value.min_budget
    assert max(s.peak_bytes for s in plan.stages) <= plan.budget_bytes
    assert all(s.plan.budget_bytes == plan.budget_bytes for s in plan.stages)
    with pytest.raises(fxopt.InfeasibleBudgetError):
        fxopt.pipeline(model, inputs, budget=plan.budget_bytes // 2, **kwargs)


def test_constants_traced_on_the_cpu_are_made_where_the_stage_runs():
    from fxopt.distributed.pipeline import place_constants_on

    class Offset(nn.Module):
        def forward(self, x):
            return x + torch.ones(x.shape[-1], device="cpu")

    outer = nn.Sequential(torch.fx.symbolic_trace(Offset()))
    place_constants_on(outer, torch.device("meta"))
    (node,) = [n for n in outer[0].graph.nodes if n.target is torch.ones]
    assert node.kwargs["device"] == torch.device("meta")
    assert outer(torch.zeros(4, device="meta")).device.type == "meta"


def test_the_loss_memory_leaves_out_the_batch_its_target_is_a_view_of():
    """torch's schedule gives the loss a microbatch of the target, a view of the caller's batch:
    the loss's memory beyond its output and target is the same as for a target of its own (it
    counted the rest of the batch before, issue 24; the last stage counts the caller's target
    itself, every microbatch of it)."""
    from fxopt.distributed.pipeline import _loss_memory
    from fxopt.options import Options

    torch.manual_seed(0)
    logits, target = torch.randn(2, 8, 32), torch.randint(0, 32, (8, 8))
    view = target[:2]
    options = Options.of(1.0)
    assert _loss_memory(lm_loss, logits, view, options) == _loss_memory(lm_loss, logits, view.clone(), options)


def test_only_the_stage_plans_go_through_the_plan_cache(tmp_path, monkeypatch):
    """The whole step and the loss are planned only to choose the cuts and the budget (SAVE
    everything, in the captured order: one walk of the graph, no dearer than its cache key): no
    cache key is made for them and nothing is written; every plan the cache holds is a stage's.
    Planning again reads each stage's plan back and gives the same pipeline plan."""
    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    keyed = []
    key = fxopt.cache.key
    monkeypatch.setattr(fxopt.cache, "key", lambda graph, *a, **k: keyed.append(len(graph)) or key(graph, *a, **k))

    def planned():
        torch.manual_seed(0)
        model, (idx,) = gpt2_lm(layers=4, dim=16, heads=2, seq=8, batch=4, vocab=32)
        return fxopt.pipeline(model, (idx,), target=torch.roll(idx, -1, 1), loss_fn=lm_loss, stages=2,
                              microbatches=2, budget=0.9, solver="greedy")

    plan = planned()
    stored = [fxopt.Plan.from_json(p) for p in sorted(tmp_path.glob("*.json"))]
    assert stored and all(p.solver != "save_all" for p in stored)
    assert {len(p.graph) for p in stored} == {len(s.plan.graph) for s in plan.stages}
    assert sorted(keyed) == sorted(len(s.plan.graph) for s in plan.stages)  # (the whole step is not hashed)
    keyed.clear()
    assert _plan_without_timings(planned()) == _plan_without_timings(plan)
    assert len(list(tmp_path.glob("*.json"))) == len(stored)


def _plan_without_timings(plan: fxopt.PipelinePlan) -> dict:
    d = plan.to_dict()
    d.pop("solve_seconds")  # (planning's wall time: the pipeline's, and each stage plan's)
    for stage in d["stages"]:
        stage["plan"].pop("solve_seconds")
    return d


def _eight_blocks_in_four_stages(monkeypatch, **options) -> tuple[fxopt.PipelinePlan, dict]:
    """An 8-block GPT-2 planned by `fxopt.pipeline` in 4 stages cut at h.2, h.4 and h.6 (greedy,
    4 microbatches, ``options``), from a fresh memo (no plan reads what an earlier one kept): the
    plan, and its `_StagePlanner`'s counted work."""
    import fxopt.distributed.pipeline as pipeline

    fxopt.cache.lowest_peaks.clear()
    made = []
    init = pipeline._StagePlanner.__init__
    monkeypatch.setattr(pipeline._StagePlanner, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    torch.manual_seed(0)
    model, (idx,) = gpt2_lm(layers=8, dim=16, heads=2, seq=8, batch=8, vocab=32)
    plan = fxopt.pipeline(model, (idx,), target=torch.roll(idx, -1, 1), loss_fn=lm_loss, stages=4, microbatches=4,
                          solver="greedy", split_points=[("h.2", "BEGINNING"), ("h.4", "BEGINNING"), ("h.6", "BEGINNING")],
                          **options)
    monkeypatch.setattr(pipeline._StagePlanner, "__init__", init)
    return plan, made[0].work


@pytest.mark.parametrize("schedule, budget", [("1F1B", 0.6), ("GPipe", "min")])
def test_stages_of_one_structure_are_captured_once_and_planned_as_alone(schedule, budget, monkeypatch):
    """Issue 27: the middle stages of a uniform model are one graph up to names, so one is
    captured and analysed and the others are planned from it (1F1B: each with its own in-flight
    microbatches; GPipe: the same, so the same plan). Every stage's plan is the one capturing it
    alone makes: the whole pipeline plan, module paths included, equals planning each stage from
    its own capture."""
    import fxopt.distributed.pipeline as pipeline

    def planned(reuse: bool):
        monkeypatch.setattr(pipeline._StagePlanner, "reuse_same_stages", reuse)
        return _eight_blocks_in_four_stages(monkeypatch, schedule=schedule, budget=budget)

    reused, work = planned(True)
    alone, alone_work = planned(False)
    assert _plan_without_timings(reused) == _plan_without_timings(alone)
    assert [s.modules for s in reused.stages] == [("wte", "h.1"), ("h.2.ln_1", "h.3"), ("h.4.ln_1", "h.5"),
                                                  ("h.6.ln_1", "lm_head")]
    assert any(s.plan.recomputed for s in reused.stages)  # (the budget is tight enough to plan something)
    assert work["captures"] == 3  # the first stage, one of the middle two, the last
    assert alone_work["captures"] >= 4 and alone_work["planned from an earlier capture"] == 0
    # torch splits the model with its 8 blocks cut to 6 (the first stage's, one middle's, the last's)
    assert work["blocks split"] == 6 and alone_work["blocks split"] == 8
    if schedule == "GPipe":  # every stage holds every microbatch: stage 2 is planned as stage 1 was
        assert work["plans reused"] >= 1


def _run(blocks: int):
    from fxopt.capture.repeat import Run

    mods = [nn.Linear(2, 2) for _ in range(blocks)]
    return Run(nn.ModuleList(mods), tuple(str(k) for k in range(blocks)), tuple(mods))


@pytest.mark.parametrize("blocks, spec, short_spec, stand_in, shift", [
    # 48 blocks in 8 stages of 6: the first stage, one middle stage, the last (18 blocks)
    (48, [(f"h.{6 * k}", "BEGINNING") for k in range(1, 8)], [("h.6", "BEGINNING"), ("h.12", "BEGINNING")],
     (0, 1, 1, 1, 1, 1, 1, 2), (0, 0, 6, 12, 18, 24, 30, 30)),
    # two middle spans (2 and 3 blocks) alternating: one of each kept
    (16, [("h.3", "BEGINNING"), ("h.5", "BEGINNING"), ("h.8", "BEGINNING"), ("h.10", "BEGINNING"),
          ("h.13", "BEGINNING")],
     [("h.3", "BEGINNING"), ("h.5", "BEGINNING"), ("h.8", "BEGINNING")], (0, 1, 2, 1, 2, 3), (0, 0, 0, 5, 5, 5)),
    # cuts inside a block, at one place in each: the middle stages are one
    (12, [("h.3.attn", "END"), ("h.6.attn", "END"), ("h.9.attn", "END")],
     [("h.3.attn", "END"), ("h.6.attn", "END")], (0, 1, 1, 2), (0, 0, 3, 3)),
    # a middle stage that starts and ends at different places in its block is kept
    (12, [("h.3", "BEGINNING"), ("h.6.attn", "END"), ("h.9.attn", "END")], None, None, None),
    # a cut outside the run: no short split
    (12, [("h.3", "BEGINNING"), ("ln_f", "BEGINNING")], None, None, None),
])
def test_a_short_split_keeps_one_stage_of_each_kind(blocks, spec, short_spec, stand_in, shift):
    """`ShortSplit`: the stages torch's split makes on the model with its run cut short, and which
    stands in for each stage of the whole split, how many blocks on (hand-worked); None where no
    block would be left out or a cut is outside the run."""
    from fxopt.distributed.pipeline import ShortSplit

    short = ShortSplit.of(_run(blocks), "h", spec)
    if short_spec is None:
        assert short is None
        return
    assert (list(short.spec), short.stand_in, short.shift) == (short_spec, stand_in, shift)
    assert short.blocks == blocks - shift[-1]


def test_a_stage_whose_paths_do_not_move_is_planned_on_its_own_part(monkeypatch):
    """A stand-in's module paths that cannot be moved to its stage's blocks (not seen: here no
    module given in their place): that stage is captured from torch's split of the whole model,
    and its plan is the one the move would have given."""
    import fxopt.distributed.pipeline as pipeline

    moved, work = _eight_blocks_in_four_stages(monkeypatch, budget=0.6)
    monkeypatch.setattr(pipeline, "_shifted_pairs", lambda *args: {})
    own, own_work = _eight_blocks_in_four_stages(monkeypatch, budget=0.6)
    assert _plan_without_timings(own) == _plan_without_timings(moved)
    # stages 2 and 3 stand in shifted: each captured from the whole split (8 blocks more split)
    assert own_work["captures"] == work["captures"] + 2 and own_work["blocks split"] == work["blocks split"] + 8


def test_stage_structure_tells_parts_apart():
    """`stage_structure`: equal for the two middle stages of a uniform stack, not for the first,
    another width or other inputs; None for a part that is not an fx graph (its code is not read).
    A captured module path moves to the module in its place, or is refused."""
    from fxopt.distributed.pipeline import _moved_paths, _NotMoved, split_model, stage_structure

    def parts(dim: int):
        torch.manual_seed(0)
        model, (idx,) = gpt2_lm(layers=8, dim=dim, heads=2, seq=8, batch=2, vocab=32)
        cuts = [("h.2", "BEGINNING"), ("h.4", "BEGINNING"), ("h.6", "BEGINNING")]
        return [s.part for s in split_model(model, (idx,), cuts, True)]

    x, narrow, wide = torch.randn(2, 8, 16), parts(16), parts(32)
    assert stage_structure(narrow[1], (x,)) == stage_structure(narrow[2], (x,)) is not None
    assert stage_structure(narrow[1], (x,)) != stage_structure(narrow[0], (x,))
    assert stage_structure(wide[1], (x,)) != stage_structure(narrow[1], (x,))
    assert stage_structure(narrow[1], (x,)) != stage_structure(narrow[1], (torch.randn(2, 4, 16),))
    assert stage_structure(nn.Linear(2, 2), (x,)) is None
    paths = ("getattr(getattr(L['self'].h, '2'), 'resid_drop@1')", "getattr(L['self'].h, '3').ln_1", "")
    assert _moved_paths(paths, narrow[1], narrow[2]) == (
        "getattr(getattr(L['self'].h, '4'), 'resid_drop@1')", "getattr(L['self'].h, '5').ln_1", "")
    with pytest.raises(_NotMoved):
        _moved_paths(("getattr(L['self'].h, '7').ln_1",), narrow[1], narrow[2])
