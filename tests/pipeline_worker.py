"""One rank of a pipeline test (started by tests/test_pipeline_runtime.py): replays a
`fxopt.PipelinePlan` on CPU with gloo, runs one step (after one that compiles its stage),
measures that step's peak, and compares its losses and gradients with the single-process eager
step on the whole batch. Everything is checked here; the rank writes what it found (and any
failure) to ``<out>/rank<k>.json``."""

from __future__ import annotations

import copy
import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import fxopt
from fxopt.distributed.pipeline import build_schedule, resident
from fxopt.models import gpt2_lm, lm_loss, skip_cnn


def workload(name: str):
    """(model, inputs, target, loss_fn), the same on every rank."""
    torch.manual_seed(0)
    if name == "gpt2":
        model, (idx,) = gpt2_lm(layers=8, dim=32, heads=2, seq=32, batch=8, vocab=128)
        return model, (idx,), torch.roll(idx, -1, 1), lm_loss
    if name == "gpt2_head":  # the head and the loss bind the last stage's memory
        model, (idx,) = gpt2_lm(layers=2, dim=32, heads=2, seq=32, batch=8, vocab=1024)
        return model, (idx,), torch.roll(idx, -1, 1), lm_loss
    model, (x,) = skip_cnn(batch=8, size=16, channels=8)
    return model, (x,), torch.randint(0, 10, (8,)), torch.nn.functional.cross_entropy


def eager_reference(model, inputs, target, loss_fn, microbatches: int):
    """The single-process step on the whole batch: each microbatch's loss, the gradients by name."""
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    with torch.no_grad():
        chunks = [t.chunk(microbatches) for t in (*inputs, target)]
        losses = [loss_fn(ref(*[c[k] for c in chunks[:-1]]), chunks[-1][k]).item() for k in range(microbatches)]
    return losses, {n: p.grad for n, p in ref.named_parameters()}


def run(rank: int, world: int, name: str, plan_path: str, out: str, init: str, backend: str = "gloo") -> None:
    result: dict = {"rank": rank, "ok": False}
    t0 = time.perf_counter()
    try:
        torch.set_num_threads(1)  # a process per stage on a few cores
        dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"file://{init}")
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        model, inputs, target, loss_fn = workload(name)
        plan = fxopt.PipelinePlan.from_json(plan_path)
        losses_ref, grads_ref = eager_reference(model, inputs, target, loss_fn, plan.microbatches)
        model.to(device)
        inputs, target = tuple(t.to(device) for t in inputs), target.to(device)
        schedule = build_schedule(plan, model, loss_fn, device=device)
        first, last = rank == 0, rank == world - 1

        def step():
            losses: list = []
            schedule.step(*(inputs if first else ()), **({"target": target, "losses": losses} if last else {}),
                          return_outputs=False)
            return losses

        step()  # compiles the stage
        result["compiled_seconds"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        peak = fxopt.measure_peak(step, resident=[resident(schedule), inputs if first else (), target if last else ()])
        result.update(peak=peak.peak_bytes, budget=plan.budget_bytes, predicted=plan.stages[rank].peak_bytes)
        params = {n: p for n, p in model.named_parameters() if any(p is q for q in schedule._stage.submod.parameters())}
        result["params"] = sorted(params)
        for n, p in params.items():
            torch.testing.assert_close(p.grad.cpu(), grads_ref[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"rank {rank}: the gradient of {n}: {m}")
        if last:
            torch.testing.assert_close(torch.tensor([v.item() for v in peak.result]), torch.tensor(losses_ref))
        # Nothing was planned on the rank: every compiled step replayed the stage's plan (or its
        # variant for steps that start with gradients held).
        part = schedule._stage.submod.part
        given = {id(part._options.plan), *map(id, part._options.alternatives)}
        result["replayed"] = [id(p) in given for p in part.plans]
        assert part.plans and all(result["replayed"]), f"rank {rank} planned anew: {result['replayed']}"
        assert peak.peak_bytes <= plan.budget_bytes, f"rank {rank}: measured {peak.peak_bytes} > {plan.budget_bytes}"
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - the parent reads the failure from the file
        result["error"] = traceback.format_exc()
    finally:
        result["seconds"] = time.perf_counter() - t0
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()
