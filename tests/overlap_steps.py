"""Communication scheduled beside compute in a sharded step, in two gloo processes, for
tests/test_fsdp.py and benchmarks/overlap.py.

`run(config, world)` spawns the processes; each builds a four-block MLP sharded with
`fxopt.distributed.fully_shard`, takes its share of one batch and, on its own rank:

  - ``forward-prefetch``: plans the step at ``BUDGET_SHARE`` of eager's predicted peak, rewrites
    it, and reports where each block's weight gather is issued in the rewritten forward against
    the previous block's last op (`fxopt.passes.waits.issue_gathers_ahead`); runs it under
    ``fxopt.optimize`` and checks its loss and gradients against single-process eager, and its
    measured peak against the plan's budget.

tests/test_fsdp.py runs config ``waits`` (`waits`: ``forward-prefetch``, ``reduce-scatter-waits``
and ``reduce-scatter-waits-mp``) in one spawn.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import fxopt
from data_parallel_steps import SAFETY_STOP, _check_and_measure, configured_worker, share_of, spawn, step
from fxopt.distributed import fsdp as sharding

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


def _planned_at_share(rank: int, world: int):
    """The MLP's sharded step at ``BUDGET_SHARE`` of eager's predicted peak: rewritten
    (`plan_and_rewrite`), and run under ``fxopt.optimize``, its loss and gradients checked against
    single-process eager and its measured peak against the plan (`_check_and_measure`). Returns
    (the rewritten step, the plan run, what was measured, its simulation with the collectives
    moved, and without)."""
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
    # (the ranks' summed loss against eager's whole-batch sum; the gradients gathered whole)
    measured = _check_and_measure(optimized, model, (x,), (loss.detach() / world, ref_grads), rank, world,
                                  lambda: optimized.plans,
                                  grads=lambda m: {n: sharding.full_tensor(m, n, p.grad) for n, p in m.named_parameters()})
    plan = optimized.plans[-1]
    moved, where_captured = simulate(plan.graph, plan.schedule), simulate(plan.graph, plan.schedule, prefetch=False)
    return ready, plan, measured, moved, where_captured


def forward_prefetch(rank: int, world: int, planned=None) -> dict:
    """Where `_planned_at_share`'s forward (``planned``, where given: its result) issues each
    block's gather, the simulated peak and forward wait with the gathers issued ahead and
    without."""
    ready, plan, measured, ahead, waited = planned or _planned_at_share(rank, world)
    return {"issue_points": issue_points(ready.forward), **measured, "recomputed": len(plan.recomputed),
            "same_plan": ready.plan.fingerprint == plan.fingerprint,
            "simulated_peak": [ahead.peak_bytes, waited.peak_bytes],
            "forward_exposed_seconds": [ahead.forward_exposed_comm_seconds, waited.forward_exposed_comm_seconds]}


def scatter_points(backward: torch.fx.GraphModule) -> list[dict]:
    """For each gradient's reduce-scatter in ``backward``: where it is issued
    (``fxopt::reduce_scatter_issue``, or ``fxopt::reduce_scatter`` where it is waited for at once)
    and waited for (``fxopt::reduce_scatter_wait``), and the compute ops (``mm``, ``addmm``,
    ``tanh_backward``) between, as node positions."""
    nodes = list(backward.graph.nodes)
    kind = [getattr(n.target, "_opname", n.op) for n in nodes]
    waits = {n.args[0]: k for k, n in enumerate(nodes) if kind[k] == "reduce_scatter_wait"}
    out = []
    for k, n in enumerate(nodes):
        if kind[k] in ("reduce_scatter_issue", "reduce_scatter"):
            w = waits.get(n, k)
            out.append({"issue": k, "wait": w,
                        "compute_between": sum(c in ("mm", "addmm", "tanh_backward") for c in kind[k + 1:w])})
    return out


def reduce_scatter_waits(rank: int, world: int, planned=None) -> dict:
    """`_planned_at_share` (``planned``, where given: its result): where each gradient's
    reduce-scatter is issued and waited for in the backward (`scatter_points`), the simulated peak
    with and without the waits moved (`fxopt.solvers.prefetch.prefetched`) and the seconds the
    backward waits for its reduce-scatters in the simulator's clock."""
    ready, plan, measured, later, at_once = planned or _planned_at_share(rank, world)
    return {**_waits_rows(ready, plan, later, at_once), **measured}


def _waits_rows(ready, plan, later, at_once) -> dict:
    """What a reduce-scatter-waits run reports of its rewritten step (``ready``), the plan run and
    that plan simulated with the waits moved (``later``) and without (``at_once``)."""
    return {"scatter_points": scatter_points(ready.backward), "same_plan": ready.plan.fingerprint == plan.fingerprint,
            "simulated_peak": [later.peak_bytes, at_once.peak_bytes],
            "reduce_exposed_seconds": [later.reduce_exposed_comm_seconds, at_once.reduce_exposed_comm_seconds]}


class _Blocks(nn.Sequential):
    def forward(self, x):  # its own forward: Dynamo runs such a module's hooks (the policy's input cast) in its graph
        for layer in self:
            x = layer(x)
        return x


def mlp_mp() -> nn.Module:
    """`mlp`'s layers and numbers in a module whose input cast the policy's root hooks run."""
    return _Blocks(*mlp())


def reduce_scatter_waits_mp(rank: int, world: int) -> dict:
    """`reduce_scatter_waits` under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` (the
    gradients reduced in bf16, each reduced shard cast to the float32 shard's dtype right after its
    wait): planned at ``BUDGET_SHARE`` of eager's predicted peak, rewritten (`plan_and_rewrite`)
    and run under ``fxopt.optimize``; the loss and every gradient (float32) equal FSDP2 eager's
    with the same policy on this rank's share within bf16's resolution (`assert_bf16_close`;
    FSDP2 averages over the ranks, `fully_shard` sums: its gradients against FSDP2's times the
    ranks), and its measured peak. Where each reduce-scatter is issued and waited for
    (`scatter_points`), the simulated peak and reduce-scatter wait with and without the moves."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from fsdp_steps import _measure, assert_bf16_close
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.solvers.schedule import simulate

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    share = share_of((batch(),), rank, world)
    eager = mlp_mp()
    for layer in eager:
        if isinstance(layer, nn.Linear):
            fsdp2_shard(layer, mp_policy=mp)
    fsdp2_shard(eager, mp_policy=mp)
    _, _, ref_loss = _measure(SumLoss(eager), eager, share)
    ref_grads = {n: p.grad.full_tensor() * world for n, p in eager.named_parameters()}
    peak = plan_and_rewrite(SumLoss(_mixed_precision_mlp()), 1.0, share).plan.peak_bytes
    budget = int(BUDGET_SHARE * peak)
    model = _mixed_precision_mlp()
    module = SumLoss(model)
    ready = plan_and_rewrite(module, budget, share)
    optimized = fxopt.optimize(module, budget)
    measured, _, loss = _measure(optimized, model, share)
    assert_bf16_close(loss, ref_loss, "loss")
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, (n, p.grad.dtype)
        assert_bf16_close(sharding.full_tensor(model, n, p.grad), ref_grads[n], f"gradient of {n}")
    plan = optimized.plans[-1]
    later, at_once = simulate(plan.graph, plan.schedule), simulate(plan.graph, plan.schedule, prefetch=False)
    casts = [n for n in ready.backward.graph.nodes if getattr(n.target, "_opname", "") == "_to_copy"
             and getattr(n.args[0].target, "_opname", "") in ("reduce_scatter_wait", "reduce_scatter")]
    return {**_waits_rows(ready, plan, later, at_once), "measured": measured, "budget": plan.budget_bytes,
            "predicted": plan.peak_bytes, "plans": len(optimized.plans), "casts_after_waits": len(casts)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _covered(lo: float, hi: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in union)


def overlap_of(events) -> dict:
    """Of a profiled run of `annotated_step`s, its gloo collectives (each on gloo's worker thread,
    ``gloo:all_gather``, ``gloo:all_reduce``: the reduce-scatters,
    `fxopt.ops.collectives.reduce_scatter`), per phase (the forward or backward annotation their
    start falls in): how many, their ms in flight, and the ms of those during which the step's own
    thread ran an aten op (its compute; a wait is not one)."""
    phases = [(e.time_range.start, e.time_range.end, e.name.removeprefix(PHASE)) for e in events
              if e.name.startswith(PHASE)]
    thread = next(e.thread for e in events if e.name.startswith(PHASE))
    compute = _union([(e.time_range.start, e.time_range.end) for e in events
                      if e.thread == thread and e.name.startswith("aten::")])
    out: dict = {}
    for e in events:
        if not e.name.startswith("gloo:"):
            continue
        lo, hi = e.time_range.start, e.time_range.end
        phase = next((name for a, b, name in phases if a <= lo < b), "between")
        row = out.setdefault(f"{phase} {e.name.removeprefix('gloo:')}",
                             {"count": 0, "in_flight_ms": 0.0, "beside_compute_ms": 0.0})
        row["count"] += 1
        row["in_flight_ms"] += (hi - lo) / 1e3
        row["beside_compute_ms"] += _covered(lo, hi, compute) / 1e3
    return dict(sorted(out.items()))


PHASE = "overlap_steps: "


def annotated_step(module, inputs):
    """`step`, its forward and backward annotated for the profiler (`overlap_of`)."""
    from torch.profiler import record_function

    with record_function(PHASE + "forward"):
        loss = module(*inputs)
    with record_function(PHASE + "backward"):
        loss.backward()
    return loss


PROFILED_STEPS = 3


def profiled(rank: int, world: int, mixed_precision: bool = False) -> dict:
    """The step at ``BUDGET_SHARE`` of eager's predicted peak, profiled on this rank over
    `PROFILED_STEPS` steps after three warm ones, with its forward all-gathers issued ahead and its
    reduce-scatters waited for later (``ahead``) and, for comparison, the same plan with the
    gathers where captured (``at once``: `fxopt.passes.recompute`'s move left out), or each
    reduce-scatter waited for where issued (`fxopt.solvers.prefetch`'s move left out); each with `overlap_of` per step, its mean wall
    seconds and its measured peak. Where ``OVERLAP_TRACE`` names a file (the environment's), rank
    0's profile of the ``ahead`` steps is written there, in Chrome's trace format.
    ``mixed_precision``: the MLP under ``MixedPrecisionPolicy(param_dtype=bf16)`` (`mlp_mp`: the
    gradients reduced in bf16, each reduced shard cast to float32 after its wait)."""
    import os
    import time
    from unittest import mock

    from torch.profiler import profile

    from fxopt.analysis.costs import CostModel
    from fxopt.plan_ahead import plan_and_rewrite

    share = share_of((batch(),), rank, world)
    sharded = _mixed_precision_mlp if mixed_precision else lambda: sharding.fully_shard(mlp())
    eager = plan_and_rewrite(SumLoss(sharded()), 1.0, share).plan.peak_bytes
    budget = int(BUDGET_SHARE * eager)
    rows = {}
    for name in ("ahead", "at once", "reduce-scatters waited at once", "ahead, priced at 0.1 GB/s"):
        model = sharded()
        module = SumLoss(model)
        priced = {"cost_model": CostModel(comm_bytes_per_second=1e8)} if "priced" in name else {}
        with mock.patch("fxopt.passes.recompute._issue_ahead") if name == "at once" else \
                mock.patch("fxopt.solvers.prefetch._wait_points", return_value={}) if "reduce" in name else _nothing():
            optimized = fxopt.optimize(module, budget, **priced)
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                step(optimized, share)
        model.zero_grad(set_to_none=True)
        peak = fxopt.measure_peak(step, optimized, share, resident=[module]).peak_bytes
        model.zero_grad(set_to_none=True)
        dist.barrier()
        with profile() as prof:
            t0 = time.perf_counter()
            for _ in range(PROFILED_STEPS):
                model.zero_grad(set_to_none=True)
                annotated_step(optimized, share)
            seconds = (time.perf_counter() - t0) / PROFILED_STEPS
        if os.environ.get("OVERLAP_TRACE") and rank == 0 and name == "ahead":
            prof.export_chrome_trace(os.environ["OVERLAP_TRACE"])
        per_step = {k: {f: round(v / PROFILED_STEPS, 2) for f, v in row.items()}
                    for k, row in overlap_of(prof.events()).items()}
        plan = optimized.plans[-1]
        rows[name] = {"overlap": per_step, "step_s": round(seconds, 4), "measured": peak, "budget": plan.budget_bytes,
                      "predicted": plan.peak_bytes, "plans": len(optimized.plans),
                      "regathered_bytes": plan.recompute_comm_bytes, "recomputed": len(plan.recomputed)}
    return rows


def _mixed_precision_mlp() -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return sharding.fully_shard(mlp_mp(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


@contextlib.contextmanager
def _nothing():
    yield


def llama_gathers(rank: int, world: int) -> dict:
    """FSDP2's ``fully_shard`` on the 4-layer `transformers` Llama of ``tests/fsdp_steps.py``,
    planned at budget 1.0 and at 17,508,616 B (FSDP2-with-checkpointing's peak in
    ``benchmarks/results/data_parallel_fsdp_llama_w2_fwdprefetch.md``), at effort 0.25: of the
    forward's all-gathers, how many the plan issues ahead of where they were captured
    (`fxopt.solvers.schedule.forward_order`), the simulated peak with and without, and the ms the
    forward waits for its gathers in the simulator's clock, with and without; of the gradients'
    reduce-scatters, how many the plan waits for later than it issues them
    (`fxopt.solvers.prefetch.prefetched`), and the ms the backward waits for them in that clock,
    with the waits moved and with each where issued."""
    import fsdp_steps
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.solvers.prefetch import is_regather, reduce_wait
    from fxopt.solvers.schedule import as_generated, forward_order, simulate

    hf, (ids, labels) = fsdp_steps.llama(4, 128)
    share = share_of((ids, labels), rank, world)
    out = {}
    for budget in (1.0, 17_508_616):
        plan = plan_and_rewrite(fsdp_steps.HFLoss(fsdp_steps._fsdp2_model(hf)), budget, share, effort=0.25,
                                time_limit=600).plan
        order = forward_order(plan.graph, plan.schedule)
        captured = sorted(order)
        gathers = [i for i in order if is_regather(plan.graph, i)]
        ahead, waited = simulate(plan.graph, plan.schedule), simulate(plan.graph, plan.schedule, prefetch=False)
        backward = as_generated(plan.graph, plan.schedule, prefetch=True).backward
        scatters = [e for e, i in enumerate(backward) if reduce_wait(plan.graph, i) is not None]
        out[str(budget)] = {"reduce_scatters": len(scatters),
                            "waited_later": sum(backward[e + 1] != reduce_wait(plan.graph, backward[e]) for e in scatters),
                            "reduce_waits_ms": [round(ahead.reduce_exposed_comm_seconds * 1e3, 3),
                                                round(waited.reduce_exposed_comm_seconds * 1e3, 3)],
                            "gathers": len(gathers), "issued_ahead": sum(order.index(i) < captured.index(i) for i in gathers),
                            "simulated_peak": [ahead.peak_bytes, waited.peak_bytes],
                            "forward_waits_ms": [round(ahead.forward_exposed_comm_seconds * 1e3, 3),
                                                 round(waited.forward_exposed_comm_seconds * 1e3, 3)]}
    return out


def waits(rank: int, world: int) -> dict:
    """tests/test_fsdp.py's three overlap tests in one spawn: ``forward-prefetch`` and
    ``reduce-scatter-waits`` read one `_planned_at_share` (the same step, planned, run and
    measured once), then ``reduce-scatter-waits-mp``; their rows by configuration."""
    planned = _planned_at_share(rank, world)
    return {"forward-prefetch": forward_prefetch(rank, world, planned),
            "reduce-scatter-waits": reduce_scatter_waits(rank, world, planned),
            "reduce-scatter-waits-mp": reduce_scatter_waits_mp(rank, world)}


CONFIGS = {"waits": waits, "forward-prefetch": forward_prefetch, "profiled": profiled, "llama-gathers": llama_gathers,
           "profiled-mp": lambda rank, world: profiled(rank, world, mixed_precision=True),
           "reduce-scatter-waits": reduce_scatter_waits, "reduce-scatter-waits-mp": reduce_scatter_waits_mp}


def run(config: str, world: int = 2, timeout: float = SAFETY_STOP) -> list[dict]:
    return spawn(configured_worker, f"overlap_steps:{config}", world, timeout)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(sys.argv[1]), indent=1))
