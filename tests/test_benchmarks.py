"""The benchmarks: the harness runs end to end on tiny models and writes sane rows; every script
writes through the harness, in one metadata format; and the one model zoo serves them and the
tests."""

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import harness, hf_models, hf_zoo, pareto, step_time
from benchmarks.harness import checkpoint_blocks
from fxopt.models import MODELS, ZOO, zoo
from fxopt.solvers.graph import Graph, Node

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_pareto_harness_tiny(tmp_path):
    pytest.importorskip("matplotlib")
    threads, cache = torch.get_num_threads(), os.environ.get("FXOPT_CACHE")
    pareto.main(["--size", "tiny", "--models", "residual_mlp", "--methods", "eager,checkpoint",
                 "--timed-steps", "1", "--device", "cpu", "--out", str(tmp_path)])
    for name in ("residual_mlp.md", "residual_mlp.json", "residual_mlp.png", "summary.md", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "residual_mlp.json").read_text())
    assert data["meta"]["complete"] and data["model"]["complete"]
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "checkpoint"}
    eager, ckpt = rows["eager"], rows["checkpoint"]
    assert eager["measured_peak_bytes"] > data["model"]["params_bytes"] > 0
    assert eager["extra_flops"] == 0 and eager["grads_equal"]
    # per-block checkpointing recomputes every block's forward and keeps less alive
    assert ckpt["grads_equal"] and ckpt["extra_flops"] > 0
    assert 0 < ckpt["measured_peak_bytes"] < eager["measured_peak_bytes"]
    assert ckpt["step_ratio"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| residual_mlp | eager |" in summary
    # the run's process-wide settings are undone
    assert torch.get_num_threads() == threads and os.environ.get("FXOPT_CACHE") == cache


@pytest.mark.parametrize("name", sorted(zoo("benchmark")))
def test_benchmark_models_return_a_loss_and_checkpoint_equally(name):
    torch.manual_seed(0)
    w = MODELS[name].workload("tiny")
    loss = w.model(*w.inputs)
    assert loss.dim() == 0
    loss.backward()
    ref = {n: p.grad.clone() for n, p in w.model.named_parameters()}
    w.model.zero_grad(set_to_none=True)
    checkpoint_blocks(w.model, w.blocks)(*w.inputs).backward()
    for n, p in w.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
    assert all("forward" not in vars(b) for b in w.blocks)  # the wrapper leaves the model as it was


@pytest.mark.parametrize("name", hf_zoo.HF_NAMES)
def test_hf_zoo_models_build_and_train_every_parameter(name):
    """Each HF model returns its own loss, and the backward reaches every parameter with a finite
    gradient that is not all zeros: a builder whose loss ignored the labels or a part of the model
    (a head left out, an input not passed) fails."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs = MODELS[f"hf-{name}"]("test")
    assert model.training and MODELS[f"hf-{name}"].source.startswith("transformers.")
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # (Whisper's positions are frozen)
    assert len(trained) > len(list(model.parameters())) // 2
    for n, p in trained:
        assert p.grad is not None, f"{n}: no gradient"
        assert torch.isfinite(p.grad).all() and p.grad.any(), f"{n}: gradient {p.grad.abs().max()}"


def test_one_model_zoo():
    """Tests and benchmarks build from one registry, `fxopt.models.MODELS`: the test zoo is its
    "test" set (the same entries), the Pareto benchmark's models its "benchmark" set, the
    Hugging Face models register in it from benchmarks/hf_zoo.py and the diffusers and timm models
    from benchmarks/library_zoo.py, each with its library's checkpointing switch; the library
    benchmark's transformers models are the "hf-" entries themselves; no other zoo is left."""
    from benchmarks import library_checkpointing, library_zoo

    assert ZOO == zoo("test") and all(ZOO[n] is MODELS[n] for n in ZOO)
    assert tuple(pareto.MODELS) == ("residual_mlp", "resnet", "unet", "gpt2", "bert")
    assert all(MODELS[f"hf-{n}"].sets == {"hf"} for n in hf_zoo.HF_NAMES) and len(hf_zoo.HF_NAMES) == 13
    assert not (BENCHMARKS / "models.py").exists() and not hasattr(hf_zoo, "HF_ZOO")
    assert not (BENCHMARKS / "library_models.py").exists()
    assert tuple(zoo("library")) == ("lib-unet", "lib-vae", "lib-dit", "lib-sd3", "lib-timm-vit", "lib-timm-convnext",
                                     "lib-titan-llama3", "lib-titan-qwen3")
    assert all(MODELS[n].sets == {"library"} and MODELS[n].source.split(".")[0] in ("diffusers", "timm", "torchtitan")
               for n in zoo("library"))
    assert all(MODELS[n].checkpointing is not None for n in (*zoo("library"), *zoo("hf")))
    assert not hasattr(library_zoo, "LIBRARY_ZOO") and not hasattr(library_zoo, "LibraryModel")
    assert library_checkpointing.entry_of("llama") is MODELS["hf-llama"]
    assert library_checkpointing.entry_of("unet") is MODELS["lib-unet"] is not MODELS["unet"]
    with pytest.raises(ValueError, match="sizes tiny, quick, full"):
        MODELS["resnet"]("huge")


@pytest.mark.slow
def test_hf_models_benchmark_tiny(tmp_path):
    """One tiny HF model through the benchmark: eager, HF checkpointing, fxopt at HF's peak."""
    pytest.importorskip("transformers")
    threads, cache = torch.get_num_threads(), os.environ.get("FXOPT_CACHE")
    out = tmp_path / "hf_models"
    hf_models.main(["--size", "test", "--models", "bert", "--methods", "eager,hf-checkpointing,fxopt",
                    "--fxopt-budgets", "hf-peak", "--time-limit", "2", "--timed-steps", "1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] and data["models"][0]["info"]["complete"]
    rows = {(r["method"], r["budget"]): r for r in data["models"][0]["rows"]}
    eager, hf, fx = rows["eager", "–"], rows["hf-checkpointing", "–"], rows["fxopt", "hf-peak"]
    assert eager["extra_flops"] == 0 and eager["grads_equal"] and eager["loss_equal"]
    # HF checkpointing recomputes every layer's forward and keeps less alive
    assert hf["grads_equal"] and hf["extra_flops"] > 0
    assert hf["measured_peak_bytes"] < eager["measured_peak_bytes"]
    # fxopt's budget is HF's measured peak, kept, with eager's gradients
    assert fx.get("error") is None, fx.get("error")
    assert fx["budget_bytes"] == hf["measured_peak_bytes"]
    assert fx["grads_equal"] and fx["loss_equal"] and fx["within_budget"]
    assert fx["predicted_peak_bytes"] <= fx["budget_bytes"]
    assert "| bert |" in out.with_suffix(".md").read_text()
    # the Markdown can be rewritten from the JSON alone
    out.with_suffix(".md").unlink()
    hf_models.main(["--report", "--out", str(out)])
    assert "| bert | fxopt | hf-peak |" in out.with_suffix(".md").read_text()
    assert torch.get_num_threads() == threads and os.environ.get("FXOPT_CACHE") == cache


def test_eager_accuracy_builds_each_suites_models():
    """Every suite of `benchmarks.eager_accuracy` gives builders that make a module and its inputs
    (the hf_zoo suite's once called a zoo API that had changed, and every row was an error)."""
    pytest.importorskip("transformers")
    from benchmarks import eager_accuracy

    for suite, name in (("hf_zoo", "gpt2"), ("issue", "opt_bench"), ("breadth", "breadth_gpt_neox")):
        model, inputs = eager_accuracy.SUITES[suite]()[name]()
        assert isinstance(model, torch.nn.Module) and isinstance(inputs, tuple) and inputs, (suite, name)
        assert model(*inputs).dim() == 0, (suite, name)


@pytest.mark.slow
def test_step_time_benchmark_tiny(tmp_path):
    """Variants of one tiny model timed round robin in one process: each row has its median step,
    its ratio to eager's, its measured peak and its parity; fxopt's rows their budget; the run's
    settings are undone (Inductor's rows are the same code path, minutes each: not here)."""
    pytest.importorskip("transformers")
    threads, cache = torch.get_num_threads(), os.environ.get("FXOPT_CACHE")
    out = tmp_path / "step_time"
    step_time.main(["--size", "test", "--models", "hf-gpt2", "--variants", "eager,fxopt-eager@1.0", "--steps", "3",
                    "--seq", "16", "--batch", "2", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "fxopt-eager@1.0"}
    assert all(len(r["step_times_ms"]) == 3 and r["step_ms"] > 0 and r["loss_equal"] and r["grads_equal"]
               for r in rows.values())
    assert rows["eager"]["vs_eager"] == 1.0
    fx = rows["fxopt-eager@1.0"]
    assert fx["within_budget"] and fx["measured_peak_bytes"] <= fx["budget_bytes"]
    assert fx["predicted_peak_bytes"] <= fx["budget_bytes"]
    assert data["models"][0]["load_start"] and data["meta"]["steps"] == 3
    # (Counted: the eager compiler's step runs no more than twice eager's Python at this size.)
    assert 0 < rows["eager"]["python_calls"] and 0 < fx["python_calls"] <= 2 * rows["eager"]["python_calls"]
    assert "| fxopt-eager@1.0 |" in out.with_suffix(".md").read_text()
    assert torch.get_num_threads() == threads and os.environ.get("FXOPT_CACHE") == cache
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") is None or "step_time" not in os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_titan_selective_context_saves_every_other_matmul():
    """step_time's torchtitan-style selective checkpointing: of four matrix products in a
    checkpointed call, the first and third are saved and the second and fourth recomputed (with
    the elementwise ops between them); the gradients are eager's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(4)]
    x = torch.randn(4, 8)

    def body(x):
        for w in ws:
            x = torch.tanh(x @ w)
        return x.sum()

    expected = torch.autograd.grad(body(x), ws)
    ran = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func)
            return func(*args, **(kwargs or {}))

    loss = checkpoint(body, x, use_reentrant=False, context_fn=step_time.titan_selective_context)
    with Count():
        got = torch.autograd.grad(loss, ws)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # (the backward's own: 2 mm per product, 1 for the first (x needs no gradient); recomputed: 2 of
    # the 4 products, where saving them all would recompute none and saving none all 4)
    assert ran.count(torch.ops.aten.mm.default) == 3 * 2 + 1 + 2


def test_step_time_fastest_at_each_memory():
    """The rows measured within each memory issue 28 compares at (HF checkpointing's peak, half of
    plain Inductor's activations), fastest first by their ratio to torch.compile, eager's and the
    failed rows aside."""
    mib = 2**20
    rows = [{"variant": "eager", "vs_compile": 1.1, "measured_peak_bytes": 80 * mib},
            {"variant": "compile", "vs_compile": 1.0, "measured_peak_bytes": 60 * mib,
             "measured_start_bytes": 20 * mib, "measured_increase_bytes": 40 * mib},
            {"variant": "fxopt-inductor@half", "vs_compile": 1.05, "measured_peak_bytes": 39 * mib},
            {"variant": "sac-compile", "vs_compile": 1.02, "measured_peak_bytes": 41 * mib},
            {"variant": "hf-ckpt-compile", "vs_compile": 1.2, "measured_peak_bytes": 30 * mib},
            {"variant": "fxopt-inductor@hf", "error": "InfeasibleBudgetError"}]
    info = {"hf_ckpt_eager_peak_bytes": 30 * mib}
    assert step_time.memories(info, rows) == [("HF checkpointing's peak", 30 * mib),
                                              ("half of plain Inductor's activations", 40 * mib)]
    at_hf = step_time.fastest_within(rows, 30 * mib)
    assert at_hf["fastest"] == "hf-ckpt-compile" and not at_hf["fxopt_fastest"]
    at_half = step_time.fastest_within(rows, 40 * mib)
    assert [v for v, _, _ in at_half["rows"]] == ["fxopt-inductor@half", "hf-ckpt-compile"]
    assert at_half["fxopt_fastest"] and at_half["by"] == "vs_compile"
    assert step_time.fastest_within(rows, 10 * mib) is None and step_time.fastest_within(rows, None) is None
    lines = step_time.at_each_memory(info, rows)
    assert "fastest: **hf-ckpt-compile** (not fxopt's)" in lines[0] and "fastest: **fxopt-inductor@half**." in lines[1]


def test_step_time_fused_variant_plans_with_the_fused_pricing(monkeypatch):
    """``fxopt-inductor@hf-fused`` (only where asked for) plans at HF's peak with Inductor and
    ``CostModel(fused_pointwise=True)``, beside ``fxopt-inductor@hf``'s default pricing; each
    fxopt row's plan is reported by op class."""
    from types import SimpleNamespace

    from fxopt.analysis import CostModel
    from fxopt.solvers.graph import Node

    assert "fxopt-inductor@hf-fused" in step_time.OPTIONAL_VARIANTS
    calls = []
    monkeypatch.setattr(step_time.fxopt, "optimize", lambda model, budget, **options: calls.append((budget, options)))
    run = SimpleNamespace(args=SimpleNamespace(variants=("fxopt-inductor@hf", "fxopt-inductor@hf-fused"),
                                               time_limit=1.0),
                          hf_peak=1000, model=torch.nn.Linear(2, 2), variants=[])
    step_time.ModelRun.make_variants(run)
    for v in run.variants:
        v.build()
    assert [v.name for v in run.variants] == ["fxopt-inductor@hf", "fxopt-inductor@hf-fused"]
    assert [(b, o["compiler"], o.get("cost_model")) for b, o in calls] == [
        (1000, "inductor", None), (1000, "inductor", CostModel(fused_pointwise=True))]
    plan = SimpleNamespace(graph=SimpleNamespace(nodes=(Node("mm", "forward", op_class="matmul"),
                                                        Node("tanh", "forward", op_class="pointwise"),
                                                        Node("view", "forward"))),
                           recomputed={"mm": 1, "tanh": 2, "view": 1})
    assert step_time.recomputed_by_class(plan) == {"matmul": 1, "other": 1, "pointwise": 2}
    row = {"variant": "fxopt-inductor@hf", "plan_recomputations": 4, "plan_extra_flops": 2e9,
           "plan_recompute_cost": 1e-3, "plan_recomputed_by_class": {"matmul": 1, "pointwise": 3}}
    assert step_time.plan_lines([row, {"variant": "compile"}]) == [
        "fxopt-inductor@hf's plan: 4 recomputations (matmul 1, pointwise 3), +2.00 GFLOP, estimated +1.00 ms"]


@pytest.mark.slow
def test_library_checkpointing_benchmark_tiny(tmp_path):
    """One tiny diffusers model through the benchmark: eager, its own checkpointing, fxopt at
    that checkpointing's measured peak, with the best simple policy beside it."""
    pytest.importorskip("diffusers")
    from benchmarks import library_checkpointing

    threads, cache = torch.get_num_threads(), os.environ.get("FXOPT_CACHE")
    out = tmp_path / "library"
    library_checkpointing.main(["--size", "test", "--models", "dit", "--time-limit", "2", "--out", str(out)])
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["models"][0]["rows"]}
    library, fx = rows["library"], rows["fxopt"]
    assert library["grads_equal"] and library["fcm_extra_flops"] > 0
    assert fx.get("error") is None, fx.get("error")
    assert fx["budget_bytes"] == library["measured_peak_bytes"]
    assert fx["within_budget"] and fx["grads_equal"]
    assert fx["fcm_extra_flops"] == fx["predicted_extra_flops"]
    assert fx["best_policy_peak_bytes"] <= fx["budget_bytes"]
    assert "| dit | diffusers |" in out.with_suffix(".md").read_text()
    assert torch.get_num_threads() == threads and os.environ.get("FXOPT_CACHE") == cache


@pytest.mark.slow
def test_fit_check_dry_run(tmp_path):
    """The GPU fit check's code paths (issue 27), on this CPU with the cpu profile: the plan made on
    fake tensors of a model built on meta is the plan made on the model's own tensors (the same
    predicted peak), and the step run at its budget measures within it, with eager's gradients."""
    from benchmarks import fit_check

    threads = torch.get_num_threads()
    fit_check.main(["--dry-run", "--models", "gpt2", "--budgets", "1.0,min", "--out", str(tmp_path / "fit")])
    row = json.loads((tmp_path / "fit.json").read_text())["rows"][0]
    assert "error" not in row, row.get("error")
    assert row["eager_measured"] <= row["eager_predicted"]
    for b in row["budgets"]:
        assert "device_error" not in b, b
        assert b["predicted"] == b["device_predicted"] and b["within"] and b["grads_equal"], b
    assert "| gpt2 | cpu | eager |" in (tmp_path / "fit.md").read_text()
    assert torch.get_num_threads() == threads


@pytest.mark.slow
def test_offload_benchmark_dry_run(tmp_path):
    """The GPU OFFLOAD benchmark's code paths, on CPU with a tiny GPT-2: every method writes a row
    with eager's gradients, and fxopt's plans keep their budget."""
    from benchmarks import offload

    cache = os.environ.get("FXOPT_CACHE")
    offload.main(["--dry-run", "--fractions", "0.5", "--timed-steps", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "offload_dry_run_cpu.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "fxopt+offload", "fxopt", "same schedule, no copies", "offload-all hooks",
                         "save_on_cpu"}
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert name == "eager" or row["grads_equal"], name
    assert rows["fxopt+offload"]["offloaded"] > 0 and rows["fxopt+offload"]["within_budget"]
    assert "measured_exposed_s" in rows["fxopt+offload"]
    assert "| 50% | fxopt+offload |" in (tmp_path / "offload_dry_run_cpu.md").read_text()
    assert os.environ.get("FXOPT_CACHE") == cache


def test_planning_time_splits_one_answer(monkeypatch):
    """`benchmarks.planning_time` times the planner's own analysis and solve (the names it wraps
    are the planner's: a rename there would leave them at zero), and capture is what is left."""
    from benchmarks import planning_time
    from fxopt.models import ZOO

    monkeypatch.setenv("FXOPT_CACHE", "0")
    model, inputs = ZOO["multi_output"]()[:2]
    row, plan = planning_time.one_answer(model, inputs, 0.9, time_limit=5)
    assert plan is not None and row["peak"] <= row["budget"]
    assert row["analysis_s"] > 0 and row["solve_s"] > 0 and row["capture_s"] > 0


def test_planning_time_splits_a_pipeline_into_its_phases(monkeypatch):
    """`benchmarks.planning_time --pipeline` times `fxopt.pipeline`'s phases by the names
    `fxopt.distributed.pipeline` calls them by (a rename there would leave one at zero), each
    exclusive (they add up to the CPU time), and reads the stage planner's counted work."""
    import time
    import warnings

    import fxopt
    import fxopt.distributed.pipeline as pl
    from benchmarks import planning_time
    from fxopt.models import gpt2_lm, lm_loss

    monkeypatch.setenv("FXOPT_CACHE", "0")
    torch.manual_seed(0)
    model, (idx,) = gpt2_lm(layers=4, dim=16, heads=2, seq=8, batch=4, vocab=32)
    phases = planning_time.Phases()
    cpu0 = time.process_time()
    with phases.installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxopt.pipeline(model, (idx,), target=torch.roll(idx, -1, 1), loss_fn=lm_loss, stages=2, microbatches=4,
                       budget=0.9, split_points=[("h.2", "BEGINNING")])
    cpu = time.process_time() - cpu0
    for phase in ("whole step (stamped capture, analysis)", "split (torch.export)", "stage captures",
                  "stage forwards (eager)", "model output and loss (eager)", "stage analyses and solves", "cut model"):
        assert phases.seconds.get(phase, 0) > 0, phase
    assert sum(phases.seconds.values()) <= cpu + 0.05
    assert phases.planners[0].work["captures"] == 2
    assert pl.split_model.__name__ == "split_model" and pl._StagePlanner.plan_stage.__name__ == "plan_stage"


def test_the_pipeline_digest_is_of_decisions_not_of_planning_time():
    """budget_holds' pipeline rows compare a quiet run's plan with a busy one's by this digest: the
    seconds planning took (the whole plan's, each stage plan's) are not in it, the decisions are.
    It hashed the plan's whole JSON before, so two runs could never agree (issue 24)."""
    import dataclasses

    import torch.nn as nn

    import fxopt
    from benchmarks.budget_holds import pipeline_digest

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    plan = fxopt.pipeline(model, (torch.randn(8, 8),), stages=2, microbatches=2, budget="min", solver="greedy")
    slower = dataclasses.replace(plan, solve_seconds=plan.solve_seconds + 60, stages=tuple(
        dataclasses.replace(s, plan=dataclasses.replace(s.plan, solve_seconds=s.plan.solve_seconds + 30))
        for s in plan.stages))
    assert pipeline_digest(slower) == pipeline_digest(plan)
    other = dataclasses.replace(plan, cuts=tuple(dataclasses.replace(c, split_point="END") for c in plan.cuts))
    assert pipeline_digest(other) != pipeline_digest(plan)


@pytest.mark.slow
def test_hf_breadth_benchmark_runs_a_row_and_reports_errors(tmp_path, monkeypatch):
    """One architecture the test suite does not otherwise train (RegNet) through the breadth
    benchmark, and one whose builder fails: an ok row within its budget, an error row, and the
    run goes on to write both."""
    pytest.importorskip("transformers")
    from benchmarks import hf_breadth

    def broken():
        raise RuntimeError("no such config")

    monkeypatch.setitem(hf_breadth.ARCHITECTURES, "broken", broken)
    out = tmp_path / "hf_breadth"
    assert hf_breadth.main(["--models", "regnet,broken", "--time-limit", "2", "--out", str(out)]) == 0
    regnet, failed = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert regnet["status"] == "ok" and regnet["measured"] <= regnet["budget"] < regnet["eager_peak"]
    assert failed == {"model": "broken", "error": "RuntimeError: no such config"}
    assert "**1 of 2 architectures ok**" in out.with_suffix(".md").read_text()


def _scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in ("__init__.py", "harness.py"))


def test_every_script_writes_through_the_harness():
    """One writer and one metadata format: no script asks git itself or names the commit under
    another key, and no script writes a file itself but the hand-offs between its processes
    (``rank<r>.json``, ``config.json``) and a report re-rendered from its own JSON."""
    hand_offs = ("rank{rank}.json", '"config.json"', 'with_suffix(".md").write_text(report(json.loads(')
    for path in _scripts():
        text = path.read_text()
        assert "rev-parse" not in text, f"{path.name} asks git itself: use harness.run_meta"
        assert "['git']" not in text and '"git"' not in text, f"{path.name}: the commit key is \"commit\""
        for line in text.splitlines():
            if "write_text(" in line or "json.dump(" in line:
                assert any(h in line for h in hand_offs), f"{path.name} writes itself: {line.strip()}"
        if "write_results" in text:
            assert "run_meta(" in text or path.name == "pareto_report.py", f"{path.name}: meta not from run_meta"


def test_old_results_files_stay_readable(tmp_path):
    """Reports re-rendered from results written before the one format (commit under "git")."""
    old = json.loads((BENCHMARKS / "results" / "hf_models.json").read_text())
    meta = old["meta"]
    old["meta"] = {("git" if k == "commit" else k): v for k, v in meta.items()}  # as written before
    assert "git" in old["meta"] and "commit" not in old["meta"]
    (tmp_path / "hf_models.json").write_text(json.dumps(old))
    hf_models.main(["--report", "--out", str(tmp_path / "hf_models")])
    assert f"commit {old['meta']['git']}" in (tmp_path / "hf_models.md").read_text()
    meta = harness.run_meta("python -m benchmarks.x", size="tiny")
    assert {"command", "date", "commit", "torch", "load", "size"} <= set(meta) and "git" not in meta
    assert harness.commit_of({"git": "abc"}) == "abc" == harness.commit_of({"commit": "abc"})


@pytest.mark.slow
def test_budget_holds_says_which_rows_the_safety_stop_cut(monkeypatch):
    """Every budget_holds row records what the safety stop said (``stopped``), and the report marks
    it: the optimize route silenced every warning, so a plan the time limit cut read as the counted
    effort's (issue 24: the bench UNet's rows on a loaded machine, its solvers left 30 s after a
    78 s capture, were taken for a regression: 1.473 GFLOP at 0.5 and 29.40 MiB at "min", where
    the same graph plans at 0.435 GFLOP and 22.42 MiB uncut). The clock the safety stop reads runs
    a million times fast here: every row is cut."""
    import argparse

    from benchmarks import budget_holds
    from clocks import every_clock

    args = argparse.Namespace(models="hf-gpt2", routes="optimize", budgets="1.0", compare=None, argv=[],
                              size="test", load=False, time_limit=60.0)
    run = budget_holds.Run(args)
    every_clock(monkeypatch, 1e6)
    cut = run.attempt("hf-gpt2", "optimize", 1.0)
    monkeypatch.undo()
    assert "within" in cut and cut["stopped"], cut.get("error")
    assert all("stopped at the time limit" in m for m in cut["stopped"])
    uncut = {**cut, "stopped": []}
    for r in (uncut, cut):
        r["budget"] = "1.0"
    report = budget_holds.report({"meta": {**run.result["meta"], "commit": "x"}, "rows": [uncut, cut]})
    assert report.count("(cut by the time limit)") == 1
    assert "1 rows cut by the safety stop (time_limit 60 s): hf-gpt2 optimize 1.0" in report


class _Kink(torch.nn.Module):
    """``relu(x * w + b) * v``, summed, with ``w`` = 1/3 and ``b`` = -1 at x = 3: the ReLU's input
    is 0 in float32 (3 times float32's 1/3 rounds to 1) and 2.98e-8 in float64 (that product is
    exact there), so one float32 rounding step at the input (one ulp) moves it across the kink."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 1 / 3))
        self.b = torch.nn.Parameter(torch.full((4,), -1.0))
        self.v = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (torch.relu(x * self.w + self.b) * self.v).sum()


@pytest.mark.parametrize("change, verdict", [("rounding", "rounding (yes in float64)"),
                                             ("loss", "**NO** (in float64 too)")])
def test_budget_holds_tells_rounding_from_a_wrong_gradient(monkeypatch, change, verdict):
    """A row whose float32 gradients differ from eager's is run again in float64: a difference
    from rounding (the step's input one ulp off, a ReLU input within rounding of 0 flipping its
    mask: the bench ResNet through Inductor, 0.0066 on its stem's weight, equal in float64) reads
    "rounding"; one in the step's math (the loss scaled by 1.001) reads NO. Before, both read NO."""
    from benchmarks import budget_holds

    monkeypatch.setitem(MODELS, "kink", lambda size: (_Kink(), (torch.tensor([3.0, 5.0, 7.0, 9.0]),)))
    routed = budget_holds.build_route

    def changed_route(route, model, budget, batch, time_limit):
        fn, plans_of = routed(route, model, budget, batch, time_limit)
        if change == "rounding":
            return (lambda x: fn(torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype)))), plans_of
        return (lambda x: fn(x) * 1.001), plans_of

    monkeypatch.setattr(budget_holds, "build_route", changed_route)
    row = budget_holds.model_row("kink", "optimize", 1.0, "test", time_limit=10)
    assert row["grads_equal"] is False  # float32: b's gradient 0 in eager, 1 in the step
    assert row["grads_equal_float64"] is (change == "rounding")
    assert budget_holds._grads(row) == verdict
    report = budget_holds.report({"meta": harness.run_meta("x", size="test", load_beside=False), "rows": [row]})
    wrong, rounding = (0, 1) if change == "rounding" else (1, 0)
    assert f"{wrong} rows' gradients differ from eager's ({rounding} more differ in float32 only" in report


@pytest.mark.slow
def test_planning_time_counts_the_nodes_traced_stamped_and_whole(monkeypatch):
    """`benchmarks.planning_time` counts the nodes of every joint graph traced for one answer: a
    run stamped traces its 3- and 4-block captures (fewer nodes than the whole step's), one
    captured whole traces the step once; the two answers are the same (`same_answer`)."""
    from benchmarks import planning_time
    import fxopt.capture.repeat as repeat
    from fxopt.models import gpt2

    monkeypatch.setenv("FXOPT_CACHE", "0")
    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    torch.manual_seed(0)
    model, inputs = gpt2(layers=6, dim=32, heads=2, seq=16, batch=2, vocab=64)[:2]
    stamped, stamped_plan = planning_time.one_answer(model, inputs, "min", time_limit=5)
    torch._dynamo.reset()
    whole, whole_plan = planning_time.one_answer(model, inputs, "min", time_limit=5, stamp=False)
    assert whole["traced_graphs"] == 1 and whole["stamp_s"] == 0
    assert abs(whole["traced_nodes"] - whole["nodes"]) < 0.01 * whole["nodes"]  # (the planner's passes)
    assert stamped["traced_graphs"] == 2 and stamped["stamp_s"] > 0
    # 3 blocks and 4, each with the step around them: more nodes than 6 blocks, fewer than 12
    assert whole["traced_nodes"] < stamped["traced_nodes"] < 2 * whole["traced_nodes"]
    assert planning_time.same_answer(stamped, whole, (stamped_plan, whole_plan))


def _sharded_step(priced_at: float) -> Graph:
    """A hand-built step of one gathered parameter ``w`` (10,000 bytes received to gather it) and
    one activation ``a`` (a MFLOP to recompute, 1e-5 s), both read in the backward after the
    300-byte temporary ``g1``: a budget of 540 B holds one of them beside ``g1``, not both."""
    return Graph((
        Node("shard", "input", bytes=25),
        Node("x", "input", bytes=100),
        Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + 10_000 / priced_at),
        Node("a", "forward", inputs=(1,), bytes=100, flops=10**6, cost=1e-5),
        Node("loss", "forward", inputs=(2, 3), bytes=4, flops=100, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("g1", "backward", inputs=(5,), bytes=300, flops=100, cost=1e-6),
        Node("g2", "backward", inputs=(6,), bytes=4, flops=100, cost=1e-6),
        Node("gw", "backward", inputs=(7, 2), bytes=4, flops=100, cost=1e-6, output=True),
        Node("gx", "backward", inputs=(7, 3), bytes=4, flops=100, cost=1e-6, output=True),
    ))


def test_regather_tradeoff_reprices_communication_and_the_choice_follows(tmp_path):
    """At 1e8 B/s the re-gather costs 1e-4 s, ten times the recompute: ``a`` is recomputed; at
    1e11 B/s it costs 1e-7 s: ``w`` is re-gathered, no FLOPs. At the graph's own 1e9 B/s the
    two are a near tie (1.01e-5 s against 1e-5 s), which the recompute wins."""
    from benchmarks import regather_tradeoff
    from fxopt.solvers import solve
    from fxopt.solvers.plan import Plan

    graph = _sharded_step(1e9)
    cheap = regather_tradeoff.repriced(graph, 1e9, 1e11)
    assert cheap.nodes[2].cost == pytest.approx(1e-7 + 1e-7) and cheap.nodes[3:] == graph.nodes[3:]
    assert regather_tradeoff.repriced(graph, 1e9, 1e9) is graph
    dear, free = regather_tradeoff.tradeoff(graph, 540, [1e8, 1e11], [1], priced_at=1e9)
    assert (dear["extra_flops"], dear["regathered_bytes"], dear["cost_s"]) == (10**6, 0, pytest.approx(1e-5))
    assert (free["extra_flops"], free["regathered_bytes"]) == (0, 10_000)
    assert free["cost_s"] == pytest.approx(1.01e-5) and free["solved_cost_s"] == pytest.approx(2e-7)
    assert dear["peak_bytes"] <= 540 and free["peak_bytes"] <= 540
    s = solve(graph, 540)
    plan = Plan.build(graph=graph, schedule=s.schedule, budget_bytes=540, eager_peak_bytes=637, solver=s.solver,
                      status=s.status, solve_seconds=0.0, fingerprint="hand-built", timeline=s.timeline,
                      lower_bound_cost=s.lower_bound_cost)
    plan.to_json(tmp_path / "plan.json")
    out = tmp_path / "tradeoff"
    regather_tradeoff.main([str(tmp_path / "plan.json"), "--rates", "1e8,1e11", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["rate"] for r in rows] == [None, 1e8, 1e11] and rows[0]["extra_flops"] == 10**6
    assert "| 1e+11 | 1 |" in out.with_suffix(".md").read_text()
    import gzip

    (tmp_path / "plan.json.gz").write_bytes(gzip.compress((tmp_path / "plan.json").read_bytes()))
    regather_tradeoff.main([str(tmp_path / "plan.json.gz"), "--rates", "1e11", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["rows"][1]["regathered_bytes"] == 10_000


def _dies(stop, plans):
    raise RuntimeError("a job that dies at once")


def test_budget_holds_load_beside_refuses_a_job_that_died():
    """The run "under load" must have had its load: the planning job beside it died at once for
    every earlier ``--load`` run (it planned at an infeasible 50%), and nothing said so."""
    import time

    from benchmarks import budget_holds

    with pytest.raises(RuntimeError, match="died"), budget_holds.load_beside(True, job=_dies) as beside:
        deadline = time.monotonic() + 600  # only a safety stop: the job dies once it has started
        while beside["alive"]() and time.monotonic() < deadline:
            time.sleep(1)


@pytest.mark.slow
def test_budget_holds_load_beside_job_plans():
    """The default job beside a ``--load`` run plans (its plans are counted) and is alive at the end."""
    import time

    from benchmarks import budget_holds

    with budget_holds.load_beside(True) as beside:
        deadline = time.monotonic() + 600  # only a safety stop: the job plans in seconds
        while beside["made"]() < 1 and time.monotonic() < deadline:
            time.sleep(1)
    assert beside["plans"] >= 1


def test_ddp_time_rows_say_where_the_all_reduces_started(one_process_group):
    """`benchmarks.data_parallel.issue_order` on one gloo process: a step whose backward all-reduces
    the gradient between its two layers' backwards (waiting for it there) counts that all-reduce as
    started before the backward ended, one that all-reduces once the whole backward has run does
    not; the ddp-time report says so beside the step's ratio to eager
    DDP's, and a results file written before these fields (no peak, no profiled step) still
    renders."""
    import torch.distributed as dist
    import torch.nn as nn

    from benchmarks import data_parallel

    class AllReduceInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)  # (waits: the first layer's backward runs after it)
            return grad

    torch.manual_seed(0)
    first, second = nn.Linear(16, 32), nn.Linear(32, 1)
    model = nn.Sequential(first, second)
    fn = lambda x, y: (second(AllReduceInBackward.apply(first(x))) - y).square().mean()  # noqa: E731
    order = data_parallel.issue_order(fn, model, (torch.randn(8, 16), torch.randn(8, 1)))
    assert order["all_reduces"] == order["started_in_backward"] == 1, order
    assert 0 <= order["first_start_ms"] <= order["last_end_ms"] <= order["backward_ms"], order

    def after_the_backward(x, y):  # (autograd runs a queued callback once the whole backward has run)
        def reduce(grad):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: dist.all_reduce(torch.ones(4)))
            return grad

        h = first(x)
        h.register_hook(reduce)
        return (second(h) - y).square().mean()

    late = data_parallel.issue_order(after_the_backward, model, (torch.randn(8, 16), torch.randn(8, 1)))
    assert late["all_reduces"] == 1 and late["started_in_backward"] == 0, late
    rows = [{"setting": data_parallel.DDP_TIME, "method": "eager", "budget_bytes": None, "step_s": 0.2, "cpu_s": 0.1,
             "order": order},
            {"setting": data_parallel.DDP_TIME, "method": "fxopt@eager (inductor)", "budget_bytes": 2 << 20,
             "peak_bytes": 1 << 20, "step_s": 0.18, "cpu_s": 0.09, "order": order}]
    old = json.loads((BENCHMARKS / "results" / "data_parallel_ddp_time.json").read_text())
    text = data_parallel.report({"meta": old["meta"], "rows": rows})
    line = next(l for l in text.splitlines() if "(inductor)" in l)
    assert "× eager DDP: 0.900 wall, 0.900 CPU" in line and "1 of 1 all-reduces started before its backward ended" in line
    assert "within budget" in line
    assert "× eager DDP: 1.111 wall, 1.102 CPU" in data_parallel.report(old)  # (no profiled step in it)
