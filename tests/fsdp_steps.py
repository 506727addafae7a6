"""Fully sharded steps in several gloo processes, for tests/test_fsdp.py and
benchmarks/data_parallel.py.

`run(config, world)` spawns ``world`` processes once; each builds the configuration's models,
takes its share of one batch and, on its own rank, measures (the third step's peak, the first
compiles) and checks:

  - FSDP2 (``fully_shard`` per block and at the root), eager and with each block under
    transformers' checkpointing;
  - `fxopt.distributed.fully_shard` + ``fxopt.optimize`` at FSDP2-with-checkpointing's measured
    peak and at ``"min"`` (config ``named-min``: at the smallest budget an `InfeasibleBudgetError`
    names): one graph with the all-gathers and reduce-scatters inside; its loss (averaged over
    ranks) and every gradient (gathered whole) equal single-process eager on the whole batch
    (each rank's loss is its mean over its tokens divided by the world size, so the
    reduce-scatters' sum is the mean);
  - FSDP2's own ``fully_shard`` model (per block and at the root) + ``fxopt.optimize`` at
    FSDP2-with-checkpointing's measured peak and at ``"min"`` (config ``fsdp2-llama-2``): one graph
    too (`fxopt.distributed.fsdp2`); its loss (averaged over ranks) and every gradient, a
    ``Shard(0)`` DTensor FSDP2 averages over the ranks, equal single-process eager on the whole
    batch; and, first, a small model whose shapes do not divide by the ranks (FSDP2 pads the last
    shards), its gradients equal FSDP2 eager's after two steps of gradient accumulation;
  - mixed precision (config ``mixed-precision``, `mixed_precision`): FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on FSDP2's model and on
    `fxopt.distributed.fully_shard`'s, against FSDP2 eager with the same policy.

tests/test_fsdp.py runs config ``tests`` (``one-graph`` then ``mixed-precision``) in one spawn.
"""

from __future__ import annotations

import copy
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fxopt
from fxopt.distributed.fsdp import held_for_gloo
from data_parallel_steps import SAFETY_STOP, configured_worker, share_of, spawn, step
from fxopt.distributed import fsdp as sharding

BATCH = 4  # the whole batch; each rank takes an equal share
SEQ = 128
# The solvers' safety stop, which capture's time shortens (`fxopt.planner`): long enough that
# effort, not the clock, ends the search, so that "min" is the same on a busy machine and a quiet
# one (at the default, runs under load named another, with 12x fewer re-gathers).
TIME_LIMIT = 600.0
# The solvers' effort in the tests' configurations (``one-graph``, ``mixed-precision``; a multiple
# of the default, `fxopt.Options.effort`): the tests check that a plan holds (measured within it,
# one graph, eager's gradients, the same plan on both ranks), not that it is the lowest, and
# planning is most of their time (at 1.0, 39 of a rank's 52 CPU seconds of ``llama-2``; at 0.25,
# 22 of 35, "min" still re-gathering 4.5 MB). The other configurations, run as a script for the
# docs' numbers, plan at the default.
TEST_EFFORT = 0.25


class HFLoss(nn.Module):
    """A `transformers` LM's loss from ``labels=``, divided by ``scale``."""

    def __init__(self, hf: nn.Module, scale: float = 1.0):
        super().__init__()
        self.hf = hf
        self.scale = scale

    def forward(self, ids, labels):
        return self.hf(input_ids=ids, labels=labels).loss / self.scale


def _ids(vocab: int):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def llama(layers: int = 4, hidden: int = 128):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                                   max_position_embeddings=SEQ, use_cache=False, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).train(), _ids(1024)


def gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=SEQ, vocab_size=1024,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).train(), _ids(1024)


MODELS = {"llama": llama, "gpt2": gpt2, "llama-2": lambda: llama(layers=2),
          "llama-2-64": lambda: llama(layers=2, hidden=64)}


def blocks(hf: nn.Module) -> list[nn.Module]:
    return list(hf.model.layers) if hasattr(hf, "model") else list(hf.transformer.h)


def _measure(module, params: nn.Module, share) -> tuple[int, float, torch.Tensor]:
    """Two steps, then the third's measured peak; the second's seconds."""
    params.zero_grad(set_to_none=True)
    step(module, share)
    params.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    step(module, share)
    second = time.perf_counter() - t0
    params.zero_grad(set_to_none=True)
    peak = fxopt.measure_peak(step, module, share, resident=[module])
    return peak.peak_bytes, second, peak.result.detach().clone()


def _fsdp2_model(hf: nn.Module, checkpointing: bool = False, mp_policy=None) -> nn.Module:
    """A copy of ``hf`` under FSDP2: ``fully_shard`` per block and at the root (with ``mp_policy``,
    FSDP2's ``MixedPrecisionPolicy``, where given)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    hf = copy.deepcopy(hf)
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in blocks(hf):
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(hf, mp_policy=mp_policy)
    return hf


def _fsdp2(hf: nn.Module, share, checkpointing: bool) -> dict:
    module = HFLoss(_fsdp2_model(hf, checkpointing))
    peak, seconds, _ = _measure(module, module, share)
    return {"measured": peak, "seconds": round(seconds, 3)}


def optimized_step(module: nn.Module, budget, share, time_limit: float = TIME_LIMIT, params: nn.Module | None = None,
                   effort: float = 1.0):
    """``module`` under ``fxopt.optimize`` at ``budget`` (and ``effort``), measured (`_measure`,
    gradients of ``params``, by default its own, zeroed between steps); with the loss summed over
    the ranks."""
    optimized = fxopt.optimize(module, budget, time_limit=time_limit, effort=effort)
    peak, seconds, loss = _measure(optimized, module if params is None else params, share)
    held_for_gloo(loss)
    dist.all_reduce(loss)
    return optimized, peak, seconds, loss


def _fxopt(hf: nn.Module, share, reference, world: int, budget, time_limit: float = TIME_LIMIT,
           effort: float = 1.0) -> dict:
    ref_loss, ref_grads = reference
    hf = sharding.fully_shard(copy.deepcopy(hf))
    optimized, peak, seconds, loss = optimized_step(HFLoss(hf, scale=world), budget, share, time_limit,
                                                    effort=effort)
    torch.testing.assert_close(loss, ref_loss)
    for name, p in hf.named_parameters():
        grad = sharding.full_tensor(hf, name, p.grad)
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m: f"gradient of {name}: {m}")
    plan = optimized.plans[-1]
    return {"measured": peak, "seconds": round(seconds, 3), "budget": plan.budget_bytes,
            "predicted": plan.peak_bytes, "recomputed": len(plan.recomputed), "plans": len(optimized.plans),
            "extra_flops": plan.recompute_flops, "regathered_bytes": plan.recompute_comm_bytes,
            "solver": f"{plan.solver} {plan.status}"}


def _plan_row(optimized, peak: int, seconds: float) -> dict:
    plan = optimized.plans[-1]
    return {"measured": peak, "seconds": round(seconds, 3), "budget": plan.budget_bytes,
            "predicted": plan.peak_bytes, "recomputed": len(plan.recomputed), "plans": len(optimized.plans),
            "bound": optimized.peak_bound_bytes, "extra_flops": plan.recompute_flops,
            "regathered_bytes": plan.recompute_comm_bytes, "solver": f"{plan.solver} {plan.status}",
            "gathers": sum(n.name.startswith("all_gather_into_tensor") for n in plan.graph.nodes)}


def _fxopt_on_fsdp2(hf: nn.Module, share, reference, world: int, budget, time_limit: float = TIME_LIMIT,
                    effort: float = 1.0) -> dict:
    """FSDP2's model under fxopt, checked against eager: FSDP2 averages the gradients over the
    ranks, so each rank's loss is its own mean."""
    from torch.distributed.tensor import DTensor, Shard

    ref_loss, ref_grads = reference
    hf = _fsdp2_model(hf)
    optimized, peak, seconds, loss = optimized_step(HFLoss(hf), budget, share, time_limit, effort=effort)
    torch.testing.assert_close(loss / world, ref_loss)
    for name, p in hf.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert p.grad.placements == (Shard(0),), (name, p.grad.placements)
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], msg=lambda m: f"gradient of {name}: {m}")
    return {**_plan_row(optimized, peak, seconds), "params": len(list(hf.parameters()))}


def _uneven_fsdp2(world: int, effort: float = 1.0) -> dict:
    """A model whose rows do not divide by the ranks: fxopt's gradients (two steps accumulated)
    equal FSDP2 eager's, parameter by parameter."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = nn.Sequential(nn.Sequential(nn.Linear(7, 5), nn.Tanh()), nn.Sequential(nn.Linear(5, 3), nn.Tanh()),
                         nn.Linear(3, 1))
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
    models = []
    for _ in range(2):
        m = copy.deepcopy(base)
        for block in m[:2]:
            fully_shard(block)
        models.append(fully_shard(m))
    eager, mine = models
    optimized = fxopt.optimize(mine, "min", time_limit=TIME_LIMIT, effort=effort)
    for _ in range(2):
        eager(x).square().sum().backward()
        optimized(x).square().sum().backward()
    for (name, p), (_, q) in zip(mine.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), msg=lambda m: f"gradient of {name}: {m}")
    return {"plans": len(optimized.plans), "recomputed": len(optimized.plans[-1].recomputed)}


def _against_checkpointing(name: str, rank: int, world: int, fxopt_rows: dict, effort: float = 1.0) -> dict:
    """FSDP2 eager and with checkpointing, then for each ``prefix: fxopt_row`` of ``fxopt_rows``,
    ``fxopt_row(hf, share, reference, world, budget, effort=effort)`` at checkpointing's measured
    peak (the largest over the ranks) and at "min" (rows ``prefix@ckpt``, ``prefix@min``)."""
    hf, inputs = MODELS[name]()
    ref = copy.deepcopy(hf)
    ref_loss = step(HFLoss(ref), inputs).detach()
    reference = ref_loss, {n: p.grad for n, p in ref.named_parameters()}
    share = share_of(inputs, rank, world)
    rows = {"fsdp2": _fsdp2(hf, share, False), "fsdp2+ckpt": _fsdp2(hf, share, True)}
    ckpt = max_over_ranks(rows["fsdp2+ckpt"]["measured"])
    for prefix, fxopt_row in fxopt_rows.items():
        rows[f"{prefix}@ckpt"] = fxopt_row(hf, share, reference, world, ckpt, effort=effort)
        rows[f"{prefix}@min"] = fxopt_row(hf, share, reference, world, "min", effort=effort)
    return rows


def fsdp2_one_graph(rank: int, world: int, names=("llama-2",)) -> dict:
    out = {"uneven": _uneven_fsdp2(world)}
    for name in names:
        out[name] = _against_checkpointing(name, rank, world, {"fxopt-fsdp2": _fxopt_on_fsdp2})
    return out


def sharded(rank: int, world: int, names=("llama", "gpt2")) -> dict:
    return {name: _against_checkpointing(name, rank, world, {"fxopt": _fxopt}) for name in names}


def one_graph(rank: int, world: int, name: str = "llama-2", effort: float = TEST_EFFORT) -> dict:
    """tests/test_fsdp.py's two one-graph tests in one spawn, sharing the model, the reference and
    FSDP2's two measured rows: `fxopt.distributed.fully_shard`'s rows (``fxopt@ckpt``,
    ``fxopt@min``, as `sharded`'s) and FSDP2's model's (``fxopt-fsdp2@...``, and ``uneven``, as
    `fsdp2_one_graph`'s), at ``effort``."""
    return {"uneven": _uneven_fsdp2(world, effort),
            name: _against_checkpointing(name, rank, world, {"fxopt": _fxopt, "fxopt-fsdp2": _fxopt_on_fsdp2},
                                         effort)}


def named_minimum(rank: int, world: int, names=("llama-2",), budget: int = 1_000_000) -> dict:
    """At a budget below every plan: the smallest budget the `InfeasibleBudgetError` names, and the
    step at it (planned, checked and measured as the rows of `sharded`)."""
    from fxopt.errors import InfeasibleBudgetError

    out = {}
    for name in names:
        hf, inputs = MODELS[name]()
        ref = copy.deepcopy(hf)
        reference = step(HFLoss(ref), inputs).detach(), {n: p.grad for n, p in ref.named_parameters()}
        share = share_of(inputs, rank, world)
        try:
            model = HFLoss(sharding.fully_shard(copy.deepcopy(hf)), scale=world)
            fxopt.optimize(model, budget, time_limit=TIME_LIMIT)(*share)
        except InfeasibleBudgetError as err:
            named = {"min_budget": err.min_budget, "exact": err.exact, "lower_bound": err.lower_bound}
        else:
            raise AssertionError(f"{name} planned at {budget} bytes: ask for less")
        out[name] = {"named": named, "fxopt@named": _fxopt(hf, share, reference, world, named["min_budget"])}
    return out


def assert_bf16_close(actual, expected, what: str = "") -> None:
    """Equal within bfloat16's resolution: torch's default bf16 tolerance element by element
    (rtol 1.6e-2, twice bf16's epsilon), with an absolute tolerance of the same share of the
    largest entry (a sum of bf16 terms rounds at the scale of its largest term: FSDP2 accumulates
    a tied parameter's gradients in bf16 before its reduce-scatter, fxopt reduces each use's in
    ``reduce_dtype`` and adds them there)."""
    scale = expected.detach().abs().max().float().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=max(1e-5, 1.6e-2 * scale),
                               msg=lambda m: f"{what}: {m}")


BUDGET_SHARE = 0.6  # of FSDP2 eager's peak, for `mixed_precision`: below it, fxopt re-gathers


def mixed_precision(rank: int, world: int, name: str = "llama-2-64", effort: float = TEST_EFFORT) -> dict:
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on ``world`` ranks:
    FSDP2 eager with it (per block and at the root), then fxopt on that FSDP2 model and on
    `fxopt.distributed.fully_shard(mp_policy=)`'s, each at `BUDGET_SHARE` of FSDP2 eager's
    measured peak (the largest over the ranks; a plan that re-gathers): on every rank, the loss and every gradient (float32, on the float32
    shards) equal FSDP2 eager's on the same share within bf16's resolution (`assert_bf16_close`;
    fully_shard's gradients are a sum over ranks: its loss is divided by the world size, FSDP2's
    averaged), one plan whose all-gathers move bf16 and whose reduce-scatters float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hf, inputs = MODELS[name]()
    share = share_of(inputs, rank, world)
    sizes = sorted(p.numel() for p in hf.parameters())
    eager = _fsdp2_model(hf, mp_policy=mp)
    peak, _, ref_loss = _measure(HFLoss(eager), eager, share)
    ref_grads = {n: p.grad.full_tensor() for n, p in eager.named_parameters()}
    assert all(g.dtype == torch.float32 for g in ref_grads.values())
    rows = {"fsdp2-mp": {"measured": peak}}
    budget = int(BUDGET_SHARE * max_over_ranks(peak))
    fsdp2_model = _fsdp2_model(hf, mp_policy=mp)
    own_model = sharding.fully_shard(copy.deepcopy(hf), mp_policy=mp)
    for row, model, scale in (("fxopt-fsdp2-mp", fsdp2_model, 1), ("fxopt-fully_shard-mp", own_model, world)):
        optimized = fxopt.optimize(HFLoss(model, scale=scale), budget, time_limit=TIME_LIMIT, effort=effort)
        measured, seconds, loss = _measure(optimized, model, share)
        assert_bf16_close(loss * scale, ref_loss, f"{row} loss")
        for n, p in model.named_parameters():
            grad = p.grad.full_tensor() if scale == 1 else sharding.full_tensor(model, n, p.grad)
            assert p.grad.dtype == torch.float32, (row, n, p.grad.dtype)
            assert_bf16_close(grad, ref_grads[n], f"{row} gradient of {n}")
        plan = optimized.plans[-1]
        gathers = sorted(n.bytes for n in plan.graph.nodes if n.name.startswith("all_gather_into_tensor"))
        scatters = sorted(n.bytes for n in plan.graph.nodes if n.name.startswith("reduce_scatter_tensor"))
        # (each rank's all-gather output is the padded whole parameter; a reduce-scatter's, its shard)
        assert gathers == sorted(2 * world * -(-n // world) for n in sizes), (row, gathers)
        assert scatters == sorted(4 * -(-n // world) for n in sizes), (row, scatters)
        rows[row] = _plan_row(optimized, measured, seconds)
    return rows


def max_over_ranks(n: int) -> int:
    t = torch.tensor([n])
    held_for_gloo(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def tests(rank: int, world: int) -> dict:
    """tests/test_fsdp.py's three tests of `fsdp_steps` in one spawn: `one_graph`'s rows, then
    `mixed_precision`'s, by configuration."""
    return {"one-graph": one_graph(rank, world), "mixed-precision": mixed_precision(rank, world)}


CONFIGS = {"tests": tests, "sharded": sharded, "named-min": named_minimum, "fsdp2-llama-2": fsdp2_one_graph,
           "one-graph": one_graph, "mixed-precision": mixed_precision,
           **{name: (lambda r, w, name=name: sharded(r, w, (name,))) for name in MODELS}}
# ("llama-2", the test's: two layers, half the compiles' time)


def run(config: str, world: int = 2, timeout: float = SAFETY_STOP) -> list[dict]:
    """Spawn ``world`` processes running ``config``; what each rank measured, by rank (the
    timeout is a safety stop against a hang, not a speed requirement)."""
    return spawn(configured_worker, f"fsdp_steps:{config}", world, timeout)


if __name__ == "__main__":
    import sys

    print(json.dumps(run(sys.argv[1]), indent=1))
