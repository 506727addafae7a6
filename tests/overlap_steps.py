"""Communication scheduled beside compute in a sharded step, in two gloo processes, for
tests/test_fsdp.py and benchmarks/overlap.py.

`run(config, world)` spawns the processes; each builds a four-block MLP sharded with
`fxopt.distributed.fully_shard`, takes its share of one batch and, on its own rank:

  - ``forward-prefetch``: plans the step at ``BUDGET_SHARE`` of eager's predicted peak, rewrites
    it, and reports where each block's weight gather is issued in the rewritten forward against
    the previous block's last op (`fxopt.passes.waits.issue_gathers_ahead`); runs it under
    ``fxopt.optimize`` and checks its loss and gradients against single-process eager, and its
    measured peak against the plan's budget.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import fxopt
from data_parallel_steps import SAFETY_STOP, configured_worker, share_of, spawn, step
from fxopt.distributed import fsdp as sharding
from fxopt.distributed.fsdp import held_for_gloo

BATCH, WIDTH, BLOCKS = 1024, 256, 4
BUDGET_SHARE = 0.85  # of eager's predicted peak: some recomputation, some room to gather ahead


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())],
                         nn.Linear(WIDTH, 1))


class SumLoss(nn.Module):
    """The model's output summed: the ranks' losses add up to the whole batch's, and the
    reduce-scatters' sums over ranks to its gradients."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).sum()


def batch() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))


def issue_points(forward: torch.fx.GraphModule) -> list[dict]:
    """For each block after the first: where its weight's all-gather is issued in ``forward``,
    and where the previous block's compute ends (its ``tanh``), as node positions."""
    nodes = list(forward.graph.nodes)

    def where(op: str) -> list[int]:
        return [k for k, n in enumerate(nodes) if getattr(n.target, "_opname", "") == op]

    weights = where("all_gather_into_tensor")[0::2]  # (each Linear gathers its weight, then its bias)
    ends = where("tanh")
    return [{"gather": weights[b], "previous_end": ends[b - 1]} for b in range(1, len(ends) + 1)]


def forward_prefetch(rank: int, world: int) -> dict:
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.solvers.schedule import simulate

    x = batch()
    ref = mlp()
    loss = ref(x).sum()
    loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    share = share_of((x,), rank, world)
    eager = plan_and_rewrite(SumLoss(sharding.fully_shard(mlp())), 1.0, share).plan.peak_bytes
    budget = int(BUDGET_SHARE * eager)
    model = sharding.fully_shard(mlp())
    module = SumLoss(model)
    ready = plan_and_rewrite(module, budget, share)
    optimized = fxopt.optimize(module, budget)
    step(optimized, share)
    model.zero_grad(set_to_none=True)
    peak = fxopt.measure_peak(step, optimized, share, resident=[module])
    total = peak.result.detach().clone()
    held_for_gloo(total)
    dist.all_reduce(total)
    torch.testing.assert_close(total, loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharding.full_tensor(model, name, p.grad), ref_grads[name], msg=lambda m: f"{name}: {m}")
    plan = optimized.plans[-1]
    ahead, waited = simulate(plan.graph, plan.schedule), simulate(plan.graph, plan.schedule, prefetch=False)
    return {"issue_points": issue_points(ready.forward), "budget": plan.budget_bytes, "predicted": plan.peak_bytes,
            "measured": peak.peak_bytes, "recomputed": len(plan.recomputed), "plans": len(optimized.plans),
            "same_plan": ready.plan.fingerprint == plan.fingerprint,
            "simulated_peak": [ahead.peak_bytes, waited.peak_bytes],
            "forward_exposed_seconds": [ahead.forward_exposed_comm_seconds, waited.forward_exposed_comm_seconds]}


CONFIGS = {"forward-prefetch": forward_prefetch}


def run(config: str, world: int = 2, timeout: float = SAFETY_STOP) -> list[dict]:
    return spawn(configured_worker, f"overlap_steps:{config}", world, timeout)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(sys.argv[1]), indent=1))
