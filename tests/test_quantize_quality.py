"""The quantization quality benchmark's pieces work on a tiny GPT (a few steps, a few seconds)."""

import copy
import math

import pytest
import torch

import fxopt
from benchmarks import quantize_quality as qq


def test_synthetic_task_is_a_markov_walk_then_its_copy():
    batches = qq.synthetic_batches(2, batch=3, seq=16, vocab=32, seed=0)
    assert len(batches) == 2
    tokens, targets = batches[0]
    assert tokens.shape == targets.shape == (3, 16)
    assert torch.equal(tokens[:, :8], tokens[:, 8:])
    assert torch.equal(targets[:, :-1], tokens[:, 1:]) and (targets[:, -1] == -100).all()
    again = qq.synthetic_batches(2, batch=3, seq=16, vocab=32, seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))  # same data for every run


def test_quantized_training_and_sqnr_on_a_tiny_gpt(tmp_path):
    pytest.importorskip("matplotlib")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = qq.convergence_model(vocab=32, seq=16, batch=4)
        batches = qq.synthetic_batches(3, batch=4, seq=16, vocab=32)
        plan = fxopt.plan(base, 0.6, batches[0], quantize="int8", time_limit=2)
        assert plan.lossy, plan.summary()
        eager = qq.train(copy.deepcopy(base), batches, lr=3e-3)
        quantized = qq.train(fxopt.optimize(copy.deepcopy(base), plan.budget_bytes, plan=plan, quantize="int8"),
                             batches, lr=3e-3)
        assert all(math.isfinite(v) for v in eager + quantized)
        assert eager[0] == pytest.approx(quantized[0], rel=1e-2)  # same weights, data and dropout
        step = qq.sqnr_trajectory(base, batches[0], plan, "int8", steps=1)[0]
        assert step["sqnr"] and min(step["sqnr"].values()) > 10
    finally:
        torch.set_num_threads(threads)
    conv = {"steps": 3, "vocab": 32, "seq": 16, "batch": 4, "lr": 3e-3, "eager_peak": plan.eager_peak_bytes,
            "min_budget_lossless": plan.budget_bytes,
            "runs": {"fp32 (eager)": {"losses": eager, "seconds": 0.0},
                     "int8": {"losses": quantized, "share": 0.6, "budget": plan.budget_bytes, "quantized": 1,
                              "quantized_fp32_bytes": 4, "quantized_bytes": 1, "seconds": 0.0}}}
    for run in conv["runs"].values():
        run["final_loss"] = sum(run["losses"]) / 3
        run["rel_diff"] = run["final_loss"] / conv["runs"]["fp32 (eager)"]["final_loss"] - 1
    qq.plot(conv, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    text = qq.markdown([], conv, {"command": "x", "date": "d", "commit": "c", "torch": "t", "sqnr_steps": 1,
                                  "seconds": 0.0})
    assert "| int8 |" in text and "int8 within 2%" in text
