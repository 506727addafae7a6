"""DDP steps with the gradients' all-reduces in fxopt's graph (`fxopt.distributed.ddp`), in
several gloo processes, for tests/test_ddp.py.

`run(config, world)` spawns ``world`` processes once; each builds a `transformers` Llama (2 layers,
hidden 128, 2x128 tokens per rank on 2 ranks; `fsdp_steps.llama`), takes its share of one batch
and, on its own rank, measures (the third step's peak; the first compiles):

  - DDP eager, and DDP with each decoder layer under transformers' checkpointing;
  - ``fxopt.optimize(DDP(model), budget)`` at DDP-with-checkpointing's measured peak (the largest
    over the ranks): its loss (averaged over the ranks) and every gradient (DDP averages them)
    equal single-process eager on the whole batch; the plan's all-reduces (one per bucket);
  - one profiled fxopt step: when the first all-reduce started and when the backward's last
    matrix product ended (the all-reduces are issued as the gradients are complete, inside the
    backward, not after it).
"""

from __future__ import annotations

import copy
import json

import torch

from data_parallel_steps import SAFETY_STOP, configured_worker, share_of, spawn, step
from fsdp_steps import HFLoss, _measure, blocks, llama, max_over_ranks, optimized_step


def _ddp(hf, checkpointing: bool = False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    hf = copy.deepcopy(hf)
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf, DDP(HFLoss(hf))


def _issue_order(module, share) -> dict:
    """One profiled step: the first all-reduce's start and the last matrix product's end (µs of
    the profiler's clock); the all-reduces' time before that end ("overlapped": gloo reduces on
    its own thread) and after it ("tail")."""
    from torch.profiler import profile

    with profile() as prof:
        step(module, share)
    events = prof.events()
    reduces = [e for e in events if e.name == "gloo:all_reduce"]
    mms = [e for e in events if e.name in ("aten::mm", "aten::addmm", "aten::bmm")]
    end = max(e.time_range.end for e in mms)
    return {"all_reduces": len(reduces), "first_all_reduce_start": min(e.time_range.start for e in reduces),
            "last_mm_end": end,
            "overlapped_ms": round(sum(max(0, min(e.time_range.end, end) - e.time_range.start) for e in reduces) / 1e3, 3),
            "tail_ms": round((max(e.time_range.end for e in reduces) - end) / 1e3, 3)}


def llama_under_ddp(rank: int, world: int) -> dict:
    hf, inputs = llama(layers=2)
    ref = copy.deepcopy(hf)
    ref_loss = step(HFLoss(ref), inputs).detach()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    share = share_of(inputs, rank, world)
    rows = {}
    for name, ckpt in (("ddp", False), ("ddp+ckpt", True)):
        model, ddp = _ddp(hf, ckpt)
        peak, seconds, _ = _measure(ddp, model, share)
        rows[name] = {"measured": peak, "seconds": round(seconds, 3)}
        if not ckpt:
            model.zero_grad(set_to_none=True)
            rows["ddp order"] = _issue_order(ddp, share)
    budget = max_over_ranks(rows["ddp+ckpt"]["measured"])
    model, ddp = _ddp(hf)
    optimized, peak, seconds, loss = optimized_step(ddp, budget, share, params=model)
    torch.testing.assert_close(loss / world, ref_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=lambda m: f"gradient of {name}: {m}")
    plan = optimized.plans[-1]
    rows["fxopt@ckpt"] = {
        "measured": peak, "seconds": round(seconds, 3), "budget": plan.budget_bytes, "predicted": plan.peak_bytes,
        "plans": len(optimized.plans), "recomputed": len(plan.recomputed), "extra_flops": plan.recompute_flops,
        "all_reduces": sum(n.name.startswith("all_reduce") for n in plan.graph.nodes),
        # Priced as communication: a ring all-reduce receives 2 (n - 1) / n of each gradient.
        "comm_bytes": sum(n.comm_bytes for n in plan.graph.nodes if n.name.startswith("all_reduce")),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "params": len(list(model.parameters())), "blocks": len(blocks(model))}
    model.zero_grad(set_to_none=True)
    rows["order"] = _issue_order(optimized, share)
    return rows


CONFIGS = {"llama": llama_under_ddp}


def run(config: str, world: int = 2, timeout: float = SAFETY_STOP) -> list[dict]:
    """Spawn ``world`` processes running ``config``; what each rank measured, by rank (the
    timeout is a safety stop against a hang, not a speed requirement)."""
    return spawn(configured_worker, f"ddp_steps:{config}", world, timeout)


if __name__ == "__main__":
    import sys

    print(json.dumps(run(sys.argv[1]), indent=1))
