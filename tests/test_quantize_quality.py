"""The quantization quality benchmark's pieces work on tiny models (a few steps, a few seconds)."""

import copy
import math

import pytest
import torch

import fxopt
from benchmarks import quantize_quality as qq
from fxopt.models import residual_mlp


def test_synthetic_task_is_a_markov_walk_then_its_copy():
    batches = qq.synthetic_batches(2, batch=3, seq=16, vocab=32, seed=0)
    assert len(batches) == 2
    tokens, targets = batches[0]
    assert tokens.shape == targets.shape == (3, 16)
    assert torch.equal(tokens[:, :8], tokens[:, 8:])
    assert torch.equal(targets[:, :-1], tokens[:, 1:]) and (targets[:, -1] == -100).all()
    again = qq.synthetic_batches(2, batch=3, seq=16, vocab=32, seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))  # same data for every run
    model = qq.convergence_model(vocab=32, seq=16, batch=3)
    assert model(*batches[0]).item() == pytest.approx(math.log(32), rel=0.1)  # GPT-2 init: starts near ln(vocab)


@pytest.mark.slow
def test_quantized_training_sqnr_and_report(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    base, inputs = residual_mlp(blocks=4, width=64, batch=1024)
    plan = fxopt.plan(base, 0.65, inputs, quantize="int8", time_limit=1)
    assert plan.lossy, plan.summary()
    fp32_bytes, q_bytes = qq.lossy_bytes(plan)
    assert 0 < q_bytes < fp32_bytes
    batches = [inputs] * 2
    eager = qq.train(copy.deepcopy(base), batches, lr=1e-3)
    quantized = qq.train(fxopt.optimize(copy.deepcopy(base), plan.budget_bytes, plan=plan, quantize="int8"),
                         batches, lr=1e-3)
    assert all(math.isfinite(v) for v in eager + quantized)
    assert eager[0] == pytest.approx(quantized[0], rel=1e-6)  # the loss is computed before any quantized read
    step = qq.sqnr_trajectory(base, inputs, plan, "int8", steps=1)
    assert len(step) == 1 and min(step[0]["sqnr"].values()) > 20
    conv = {"steps": 2, "vocab": 32, "seq": 16, "batch": 4, "lr": 1e-3, "eager_peak": plan.eager_peak_bytes,
            "min_budget_lossless": plan.budget_bytes,
            "runs": {"fp32 (eager)": {"losses": eager, "seconds": 0.0},
                     "int8": {"losses": quantized, "share": 0.65, "budget": plan.budget_bytes,
                              "quantized": len(plan.lossy), "quantized_fp32_bytes": fp32_bytes,
                              "quantized_bytes": q_bytes, "seconds": 0.0}}}
    for run in conv["runs"].values():
        run["final_loss"] = sum(run["losses"]) / 2
        run["rel_diff"] = run["final_loss"] / conv["runs"]["fp32 (eager)"]["final_loss"] - 1
    qq.plot(conv, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    text = qq.markdown([], conv, {"command": "x", "date": "d", "commit": "c", "torch": "t", "sqnr_steps": 1,
                                  "seconds": 0.0, "fxopt_uncommitted": []})
    assert "| int8 |" in text and "int8 within 2%" in text
