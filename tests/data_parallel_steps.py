"""Training steps under DDP and FSDP2 in several processes, for tests/test_data_parallel.py.

`run(config, world)` spawns ``world`` gloo processes (CPU) once; each builds every model of the
configuration, takes its share of one batch, trains three steps through fxopt and checks, on its
own rank: the loss averaged over ranks and every gradient equal to single-process eager on the
whole batch, and the third step's measured peak within the plan's budget (the first step compiles,
the second is where DDP rebuilds its buckets). Each rank writes what it measured to a JSON file.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from fxopt.solvers import DEFAULT_TIME_LIMIT
import fxopt
from fxopt.distributed.fsdp import held_for_gloo
from fxopt.distributed.data_parallel import bucket_bytes

BATCH = 8  # the whole batch; each of the ranks takes an equal share
TIME_LIMIT = DEFAULT_TIME_LIMIT  # a safety stop: the solvers' effort is counted, not timed


class HFLoss(nn.Module):
    def __init__(self, hf: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.hf = hf
        self.names = names

    def forward(self, *inputs):
        return self.hf(**dict(zip(self.names, inputs))).loss


def gpt2():
    """A small `transformers` GPT-2 LM, loss from ``labels=`` (no padding: each rank's mean loss is
    over as many tokens, so their average is the whole batch's)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_inner=64, n_positions=64, vocab_size=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (BATCH, 64), generator=torch.Generator().manual_seed(1))
    return HFLoss(transformers.GPT2LMHeadModel(cfg).train(), ("input_ids", "labels")), (ids, ids.clone())


def convnext():
    """A small `transformers` ConvNeXt classifier (depthwise convolutions, LayerNorm)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=10,
                                      drop_path_rate=0.0)
    g = torch.Generator().manual_seed(1)
    pixels, labels = torch.randn(BATCH, 3, 64, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    return HFLoss(transformers.ConvNextForImageClassification(cfg).train(), ("pixel_values", "labels")), (pixels, labels)


MODELS = {"gpt2": gpt2, "convnext": convnext}


def share_of(inputs, rank: int, world: int):
    """Rank ``rank``'s equal share of the whole batch (each input's first dimension)."""
    return tuple(t[rank * (len(t) // world):(rank + 1) * (len(t) // world)] for t in inputs)


def step(module, inputs):
    loss = module(*inputs)
    loss.backward()
    return loss


def _reference(model, inputs):
    """Loss and gradients of single-process eager on the whole batch."""
    ref = copy.deepcopy(model)
    loss = step(ref, inputs)
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_and_measure(wrapped, model, inputs, reference, rank, world, plan_of, grads=_grads,
                       step_budget: int | None = None) -> dict:
    """Three steps of ``wrapped`` on this rank's share; the reference checks; the third measured."""
    ref_loss, ref_grads = reference
    share = share_of(inputs, rank, world)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(wrapped, share)
    model.zero_grad(set_to_none=True)
    peak = fxopt.measure_peak(step, wrapped, share, resident=[wrapped])
    loss = peak.result.detach().clone()
    held_for_gloo(loss)
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world, ref_loss)
    grads = grads(model)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m: f"gradient of {name}: {m}")
    plans = [p for p in plan_of()]
    assert plans, "no plan was made"
    # The step's budget: a whole step's plan has it; pieces were planned within what it leaves
    # beside each (its budget_bytes), so each bounds the step at budget - its budget + its peak.
    budget = step_budget if step_budget is not None else plans[-1].budget_bytes
    bound = max(budget - p.budget_bytes + p.peak_bytes for p in plans)
    return {"measured": peak.peak_bytes, "budget": budget, "predicted": bound, "plans": len(plans),
            "recomputations": sum(len(p.recomputed) for p in plans)}


DDP_ORDERS = {"gpt2": ("inner", "outer"), "convnext": ("outer",)}  # each order on the transformer, one on the CNN


def ddp(rank: int, world: int) -> dict:
    """DDP(fxopt.optimize(model)) ("inner") and fxopt.optimize(DDP(model)) ("outer")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, build in MODELS.items():
        for order in DDP_ORDERS[name]:
            t0 = time.monotonic()
            model, inputs = build()
            reference = _reference(model, inputs)
            if order == "inner":
                optimized = fxopt.optimize(model, BUDGET[name], time_limit=TIME_LIMIT)
                wrapped = DDP(optimized)
                plans = lambda: optimized.plans  # noqa: E731
                ddp_module = wrapped
            else:
                ddp_module = DDP(model)
                wrapped = fxopt.optimize(ddp_module, BUDGET[name], time_limit=TIME_LIMIT)
                plans = lambda: wrapped.plans  # noqa: E731
            result = _check_and_measure(wrapped, model, inputs, reference, rank, world, plans)
            result["buckets"] = bucket_bytes(ddp_module)
            # The second order reduces in fxopt's graph (fxopt.distributed.ddp), the first by DDP's reducer.
            result["all_reduces"] = sum(n.name.startswith("all_reduce") for p in plans() for n in p.graph.nodes)
            result["seconds"] = round(time.monotonic() - t0, 1)
            out[f"{name}/{order}"] = result
    return out


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a user shards with ``fully_shard`` one by one."""
    hf = model.hf
    return list(hf.transformer.h) if hasattr(hf, "transformer") else list(hf.convnext.encoder.stages)


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def _full_grads(model):
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def fsdp(rank: int, world: int) -> dict:
    """fxopt.optimize of a model sharded with FSDP2's fully_shard per block (and at the root):
    one graph (`fxopt.distributed.fsdp2`)."""
    out = {}
    for name, build in MODELS.items():
        t0 = time.monotonic()
        model, inputs = build()
        reference = _reference(model, inputs)
        shard(model)
        optimized = fxopt.optimize(model, FSDP_BUDGET[name], time_limit=TIME_LIMIT)
        result = _check_and_measure(optimized, model, inputs, reference, rank, world, lambda: optimized.plans,
                                    grads=_full_grads, step_budget=FSDP_BUDGET[name])
        result["seconds"] = round(time.monotonic() - t0, 1)
        out[name] = result
    return out


BUDGET = {"gpt2": 0.6, "convnext": 0.8}
FSDP_BUDGET = {"gpt2": 2_500_000, "convnext": 2_500_000}  # bytes
CONFIGS = {"ddp": ddp, "fsdp": fsdp}


def _worker(rank: int, world: int, port: int, config: str, out_dir: str) -> None:
    # Each rank's own plan cache: a step captured again (DDP's other order) replays its plan, which
    # it finds only if it captured the same graph.
    os.environ.update(FXOPT_CACHE="1", FXOPT_CACHE_DIR=str(Path(out_dir, f"plans-{rank}")))
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = CONFIGS[config](rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{config}-{rank}.json").write_text(json.dumps(results))


def configured_worker(rank: int, world: int, port: int, target: str, out_dir: str) -> None:
    """`spawn`'s worker for a configuration ``target`` ("module:config", a key of that module's
    ``CONFIGS``): one torch thread, the plan cache off; writes ``<target>-<rank>.json``."""
    import importlib

    module, config = target.split(":", 1)
    torch.set_num_threads(1)
    os.environ.update(FXOPT_CACHE="0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = importlib.import_module(module).CONFIGS[config](rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{target}-{rank}.json").write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A safety stop against a hang, never a speed requirement: a quiet 2-core run of any configuration
# takes well under a minute. Each rank prints its threads' Python stacks to stderr a little before
# it, so a hang says where it was (the output pytest captured shows them).
SAFETY_STOP = 900.0


def _guarded(rank: int, worker, stop: float, *args) -> None:
    faulthandler.dump_traceback_later(max(1.0, stop - 30.0), exit=False)
    try:
        worker(rank, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawn(worker, config: str, world: int, timeout: float = SAFETY_STOP) -> list[dict]:
    """Spawn ``world`` processes running ``worker(rank, world, port, config, out_dir)`` (a
    module-level function, which writes ``<config>-<rank>.json`` into ``out_dir``); what each
    rank measured, by rank. ``timeout`` is a safety stop against a hang (see `SAFETY_STOP`)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_guarded, args=(worker, timeout, world, free_port(), config, out_dir), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{config}: {world} processes still running after {timeout:.0f} s "
                                   "(a safety stop: each rank's stacks are printed above)")
        return [json.loads(Path(out_dir, f"{config}-{r}.json").read_text()) for r in range(world)]


def run(config: str, world: int = 2, timeout: float = SAFETY_STOP) -> list[dict]:
    """Spawn ``world`` processes running ``config``; what each rank measured, by rank."""
    return spawn(_worker, config, world, timeout)


if __name__ == "__main__":
    import sys

    print(json.dumps(run(sys.argv[1]), indent=1))
