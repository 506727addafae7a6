"""fxopt under data parallelism (issue 16), on CPU with gloo: DDP in both orders and FSDP2 per
block, on a `transformers` GPT-2 and ConvNeXt (DDP: both orders on GPT-2, the second on
ConvNeXt). Each configuration spawns two processes once (`data_parallel_steps.run`), which check, on every rank, the loss and every gradient against
single-process eager on the whole batch and measure the third step's peak; here, every rank's
measured peak is within the budget and the plans' bound. Refusals run in this process, on a
one-process gloo group."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxopt
from fxopt.distributed import data_parallel

pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.slow]  # several processes per test

from data_parallel_steps import run  # noqa: E402


def _check(results: list[dict], *, recompute: bool = True) -> None:
    assert len(results) == 2
    for rank, cases in enumerate(results):
        for case, r in cases.items():
            where = f"rank {rank}, {case}: measured {r['measured']}, bound {r['predicted']}, budget {r['budget']}"
            assert r["measured"] <= r["predicted"] <= r["budget"], where
            assert not recompute or r["recomputations"] > 0, f"{where}: the budget asked for nothing"


def test_ddp_both_orders():
    """DDP(fxopt.optimize(model)) and fxopt.optimize(DDP(model)) on GPT-2, the second order on
    ConvNeXt: one plan for the whole step, with DDP's gradient buckets counted. The second order
    has the gradients' all-reduces inside its graph (`fxopt.distributed.ddp`), the first leaves
    them to DDP's reducer; on GPT-2 both measure the same peak and plan the same bound (the
    all-reduces' buffers, late in the backward, are not at the peak)."""
    results = run("ddp")
    _check(results)
    for cases in results:
        assert set(cases) == {"gpt2/inner", "gpt2/outer", "convnext/outer"}
        inner, outer = cases["gpt2/inner"], cases["gpt2/outer"]
        assert inner["buckets"] > 0 and cases["convnext/outer"]["buckets"] > 0
        assert inner["all_reduces"] == 0 and outer["all_reduces"] > 0 and cases["convnext/outer"]["all_reduces"] > 0
        assert (inner["measured"], inner["predicted"]) == (outer["measured"], outer["predicted"])


def test_fsdp2_per_block():
    """fully_shard per block and at the root, planned as one graph (`fxopt.distributed.fsdp2`; GPT-2's
    embedding is tied to its head): one plan per compiled step, each rank within the budget."""
    results = run("fsdp")
    _check(results)
    for cases in results:
        # ConvNeXt's loss sets config.problem_type at its first call, so Dynamo compiles its step
        # again at the second: a plan each time, both of the whole step.
        assert {case: r["plans"] for case, r in cases.items()} == {"gpt2": 1, "convnext": 2}, cases


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def test_ddp_refusals_and_buckets(one_process_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    ddp = DDP(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert data_parallel.bucket_bytes(ddp) == params
    # fxopt.measure_peak counts the buckets as resident: no tensor of the model shows them.
    x = torch.randn(8, 16)
    peak = fxopt.measure_peak(lambda: None, resident=[ddp, x])
    assert peak.start_bytes == 2 * params + x.numel() * 4

    ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(fxopt.CaptureError, match="communication hook"):
        fxopt.optimize(ddp, 0.8)
    inner = DDP(fxopt.optimize(_mlp(), 0.8))
    inner.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(fxopt.CaptureError, match="communication hook"):
        inner(x)


def test_fsdp2_refusals(one_process_group):
    """An FSDP2 model planned in pieces (a unit without gradient sync: FSDP2's hooks must run)
    needs a budget in bytes and graph breaks allowed, and has no plan ahead; one planned as one
    graph has all three; mixed precision is refused in pieces (one graph follows it:
    tests/test_fsdp.py::test_mixed_precision_as_fsdp2s)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _mlp()
    fully_shard(model[0])
    fully_shard(model)
    model.set_requires_gradient_sync(False)
    with pytest.warns(UserWarning, match="in pieces"):
        with pytest.raises(fxopt.BudgetError, match="in bytes"):
            fxopt.optimize(model, 0.5)
        with pytest.raises(fxopt.CaptureError, match="graph_breaks='split'"):
            fxopt.optimize(model, "1MiB", graph_breaks="error")
        with pytest.raises(fxopt.CaptureError, match="block by block"):
            fxopt.plan(model, "1MiB", (torch.randn(4, 16),))
    model.set_requires_gradient_sync(True)
    plan = fxopt.plan(model, "min", (torch.randn(4, 16),))
    assert sum(n.name.startswith("all_gather_into_tensor") for n in plan.graph.nodes) == 4
    fxopt.optimize(model, 0.9, graph_breaks="error")
    mixed = _mlp()
    fully_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fxopt.optimize(mixed, "1MiB", graph_breaks="error")
    mixed.set_requires_gradient_sync(False)
    with pytest.warns(UserWarning, match="in pieces"), pytest.raises(fxopt.CaptureError, match="MixedPrecisionPolicy"):
        fxopt.optimize(mixed, "1MiB")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_on_nccl(tmp_path):
    """The benchmark's GPU row: world size 1 on NCCL runs DDP's reducer and FSDP2's collectives on
    the device; every fxopt row that plans is within its budget, with eager's gradients."""
    import json

    from benchmarks import data_parallel as bench

    out = tmp_path / "gpu"
    bench.main(["--size", "quick", "--device", "cuda", "--backend", "nccl", "--world", "1", "--time-limit", "2",
                "--timed-steps", "1", "--retries", "1", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    planned = [r for r in rows if r["method"].startswith("fxopt") and r.get("peak_bytes") is not None]
    assert planned, rows
    for r in planned:
        assert r["peak_bytes"] <= r["budget_bytes"] and r["grads_equal"], r
