"""fxopt under data parallelism against what those users do today: DDP and FSDP2 with per-block
``torch.utils.checkpoint``.

    python -m benchmarks.data_parallel                       # 2 gloo processes on CPU, Llama
    python -m benchmarks.data_parallel --model gpt2 --settings fsdp --world 4   # GPT-2, 4 processes
    python -m benchmarks.data_parallel --device cuda --backend nccl --world 1   # the GPU row

Model (``--model``): a `transformers` causal LM from a config (random weights, dropout off, loss
from ``labels=``): Llama (the default), GPT-2 (its embedding tied to the output layer) or GPT-NeoX
(Pythia's: attention and MLP in parallel off one residual, partial rotary embeddings; in no test),
each rank training on its share of one batch. For each setting (``DDP(model)``; ``fully_shard``
per decoder layer and at the root) the rows are: eager; per-block checkpointing (each decoder
layer's forward under ``torch.utils.checkpoint``, non-reentrant, as `benchmarks.harness`
wraps it); fxopt with that checkpointing's measured per-rank peak as its budget, in bytes
(``fxopt.optimize(DDP(model), budget)``; ``fxopt.optimize(fsdp2_model, budget)``, whose step is
one graph, `fxopt.distributed.fsdp2`), and, for DDP, when fxopt cannot plan at that peak, fxopt
at the smallest budget it names (tried again at most ``--retries`` times), and fxopt at eager's
measured peak (nothing to recompute: the step time of fxopt's graph, the gradients' all-reduces
inside it, `fxopt.distributed.ddp`, beside eager DDP's; setting ``ddp-time``: that row under the eager
compiler and under Inductor, steps interleaved, with rank 0's all-reduces against its backward). For FSDP: fxopt on FSDP2's model, and on the same model sharded
with `fxopt.distributed.fully_shard` instead, each at checkpointing's peak and at ``"min"``.

Per row and rank: the measured peak (`fxopt.measure_peak` of the third step, with DDP's buckets
counted on CPU; on CUDA ``max_memory_allocated``), the FLOPs of one step counted by
`fxopt.measure.count_flops` (extra: above eager's), the median step time of ``--timed-steps``
steps, and the loss (its mean over the ranks) and every gradient (whole) against single-process
eager on the whole batch, on every rank: the gradient of the whole batch's mean loss (DDP and FSDP2
average the ranks' gradients; under `fxopt.distributed.fully_shard`, which sums them, each rank's
loss is divided by the world size). The table reports the largest peak and step time over the
ranks. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import fxopt
from fxopt.distributed.fsdp import held_for_gloo
from benchmarks.harness import (checkpoint_blocks, error_line, load_average, log, median_step_seconds, report_head,
                                run_meta, write_results)
from fxopt.measure import count_flops
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

MiB = 2**20
SIZES = {  # layers, hidden, heads, ffn, seq, batch per rank, vocab
    "bench": dict(layers=4, hidden=128, heads=4, ffn=512, seq=128, batch=4, vocab=1024),
    "quick": dict(layers=2, hidden=64, heads=2, ffn=256, seq=64, batch=2, vocab=512),
}
SETTINGS = ("ddp", "fsdp")
# Not run by default: eager DDP and fxopt at eager's peak (nothing recomputed), under each compiler
# (`DDP_TIME_ROUTES`), their steps interleaved round by round on each rank, wall and CPU seconds
# (`interleaved_ddp`).
DDP_TIME = "ddp-time"
MODELS = ("llama", "gpt2", "gpt-neox")
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt-neox": "GPTNeoXForCausalLM"}
FSDP2_ONE_GRAPH = "fxopt on FSDP2 (one graph)"  # fxopt.optimize(FSDP2's model): fxopt.distributed.fsdp2
FULLY_SHARD = "fxopt fully_shard (one graph)"  # fxopt.distributed.fully_shard, then fxopt.optimize
FORMS = {"fsdp2": FSDP2_ONE_GRAPH, "fully_shard": FULLY_SHARD}
# A row planned with communication priced at NCCL's rate (`fxopt.analysis.costs.COMM_BYTES_PER_SECOND`),
# the plan a GPU would get, run on this backend: its FLOPs and peak are counted and measured as any
# row's; its step time is of this backend's communication, not NCCL's.
NCCL_PRICED = " (comm priced as NCCL)"


class Loss(nn.Module):
    """The LM's loss, divided by ``scale`` (the world size, under `fxopt.distributed.fully_shard`,
    whose reduce-scatters sum the ranks' gradients: the mean, as FSDP2 and DDP average)."""

    def __init__(self, hf: nn.Module, scale: int = 1):
        super().__init__()
        self.hf = hf
        self.scale = scale

    def forward(self, ids, labels):
        loss = self.hf(input_ids=ids, labels=labels).loss
        return loss / self.scale if self.scale != 1 else loss


def _config(name: str, c: dict):
    import transformers

    if name == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
            num_key_value_heads=max(1, c["heads"] // 2), intermediate_size=c["ffn"], vocab_size=c["vocab"],
            max_position_embeddings=c["seq"], use_cache=False)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_layer=c["layers"], n_embd=c["hidden"], n_head=c["heads"], n_inner=c["ffn"], n_positions=c["seq"],
            vocab_size=c["vocab"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
        intermediate_size=c["ffn"], vocab_size=c["vocab"], max_position_embeddings=c["seq"],
        hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``model`` (a `Loss`), which FSDP2 shards one by one and per-block
    checkpointing wraps."""
    hf = model.hf
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        try:
            return list(hf.get_submodule(path))
        except AttributeError:
            continue
    raise ValueError(f"no decoder blocks found in {type(hf).__name__}")


def whole_batch(size: str, world: int) -> torch.Tensor:
    c = SIZES[size]
    return torch.randint(0, c["vocab"], (world * c["batch"], c["seq"]), generator=torch.Generator().manual_seed(1))


def build(size: str, world: int, rank: int, device: torch.device, name: str = "llama"):
    """The model (same weights on every rank) and this rank's share of the batch."""
    c = SIZES[size]
    torch.manual_seed(0)
    cls, cfg = _config(name, c)
    model = Loss(cls(cfg)).train().to(device)
    share = whole_batch(size, world)[rank * c["batch"]:(rank + 1) * c["batch"]].to(device)
    return model, (share, share.clone())


def single_process(args, world: int, device: torch.device) -> dict[str, Any]:
    """Single-process eager on the whole batch (every rank's share): its loss (the mean over the
    batch's tokens) and every gradient."""
    model, _ = build(args.size, world, 0, device, args.model)
    ids = whole_batch(args.size, world).to(device)
    loss = _step(model, (ids, ids.clone()))
    return {"loss": float(loss), "grads": {n: p.grad.detach().to("cpu", copy=True)
                                           for n, p in model.named_parameters() if p.grad is not None}}


def _wrap(setting: str, model: nn.Module, device: torch.device, one_graph: bool = False) -> nn.Module:
    if one_graph:  # the step as one graph, the all-gathers and reduce-scatters inside fxopt's plan
        from fxopt.distributed import fsdp

        fsdp.fully_shard(model.hf)
        model.scale = dist.get_world_size()
        return model
    if setting == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in blocks_of(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _step(fn, inputs):
    loss = fn(*inputs)
    loss.backward()
    return loss.detach()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from fxopt.distributed import fsdp

    out = {}
    sharded = fsdp.is_sharded(model)
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            g = fsdp.full_tensor(model, name, g) if sharded else g
            out[name.removeprefix("module.")] = g.detach().to("cpu", copy=True)
    return out


def _two_steps(fn, model: nn.Module, inputs) -> None:
    """Two steps, each from no gradients (the first compiles and plans, the second is where DDP
    rebuilds its buckets), and the gradients cleared after: the third step is the steady one."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _step(fn, inputs)
    model.zero_grad(set_to_none=True)


def measure(fn, model: nn.Module, wrapped: nn.Module, inputs, timed_steps: int, device: torch.device) -> dict[str, Any]:
    """Three steps (the first compiles and plans, the second is where DDP rebuilds its buckets),
    the third measured; one counted; ``timed_steps`` timed."""
    _two_steps(fn, model, inputs)
    peak = fxopt.measure_peak(_step, fn, inputs, resident=[fn, wrapped, model])
    row = {"peak_bytes": peak.peak_bytes, "loss": _mean_over_ranks(float(peak.result) * getattr(model, "scale", 1), device),
           "grads": _grads(model)}
    model.zero_grad(set_to_none=True)
    row["flops"] = count_flops(_step, fn, inputs)
    row["step_s"] = median_step_seconds(lambda: _step(fn, inputs), model, timed_steps, device)
    return row


def _plan_fields(fn) -> dict[str, Any]:
    plans = list(getattr(fn, "plans", []))
    return {"plans": len(plans), "peak_bound_bytes": fn.peak_bound_bytes,
            "recomputations": sum(sum(p.recomputed.values()) for p in plans),
            "predicted_extra_flops": sum(p.recompute_flops for p in plans),
            "regathered_bytes": sum(p.recompute_comm_bytes for p in plans),
            "planned_budget_bytes": plans[-1].budget_bytes if plans else None,
            "solve_s": round(sum(p.solve_seconds for p in plans), 1),
            "statuses": sorted({f"{p.solver} {p.status}" for p in plans}),
            # What the solvers minimised (estimated seconds: FLOPs, memory traffic, per-op overhead,
            # re-gathers' communication) and the proven lower bound on it: how far from the best
            # plan within the budget each may be.
            "cost_s": [p.cost for p in plans], "lower_bound_s": [p.lower_bound_cost for p in plans],
            "gaps": [p.gap for p in plans],
            # The seconds the step waits for its gradients' reductions (reduce-scatters,
            # all-reduces) and for all its collectives, as the simulator runs the plans
            # (`fxopt.solvers.schedule.Timeline`; simulated here so that older plans say it too).
            **_simulated_waits(plans)}


def _simulated_waits(plans) -> dict[str, float]:
    from fxopt.solvers.schedule import simulate

    timelines = [simulate(p.graph, p.schedule) for p in plans]
    reductions = sum(t.reduce_exposed_comm_seconds for t in timelines)
    return {"reduce_wait_ms": round(1e3 * reductions, 3),
            "comm_wait_ms": round(1e3 * sum(reductions + t.forward_exposed_comm_seconds + t.exposed_comm_seconds
                                            for t in timelines), 3)}


def _write_plans(fn, directory: str, model: str, world: int, method: str) -> None:
    """Each plan of an fxopt row as JSON (``--plans``; its solver graph included, to study the plan
    in one process: `benchmarks.regather_tradeoff`)."""
    slug = _slug(method)
    for i, plan in enumerate(getattr(fn, "plans", [])):
        Path(directory).mkdir(parents=True, exist_ok=True)
        plan.to_json(Path(directory, f"{model}_w{world}_{slug}_{i}.json"))


# The fxopt rows of the ddp-time setting, each at eager DDP's measured peak: fxopt's options.
DDP_TIME_ROUTES = {"fxopt@eager": {}, "fxopt@eager (inductor)": {"compiler": "inductor"}}


def interleaved_ddp(args, rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Eager DDP and ``fxopt.optimize(DDP(model), eager's peak)`` (nothing recomputed: the step
    time of fxopt's graph with the gradients' all-reduces inside it), once per compiler
    (`DDP_TIME_ROUTES`), built side by side, warmed up (3 steps each), then ``--timed-steps``
    rounds of one step of each, the ranks meeting at a barrier before every step: each one's
    median wall seconds and median CPU seconds of this process (`time.process_time`: gloo's worker
    threads included), which another job on the machine slows less than the wall clock. Before
    the timed rounds, for every row: the measured peak of one step, its loss and gradients (against
    single-process eager's), and one profiled step's all-reduces against its backward
    (`issue_order`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    single = single_process(args, world, device)
    eager_model, inputs = build(args.size, world, rank, device, args.model)
    eager = DDP(eager_model)
    _two_steps(eager, eager_model, inputs)  # (until 82a905f the gradients of the step before were held: 50.86 MiB)
    peak = _agreed_max(fxopt.measure_peak(_step, eager, inputs, resident=[eager, eager_model]).peak_bytes, device)
    runs = {"eager": (eager_model, eager, eager)}
    for name, options in DDP_TIME_ROUTES.items():
        model, _ = build(args.size, world, rank, device, args.model)
        ddp = DDP(model)
        runs[name] = (model, ddp, fxopt.optimize(ddp, peak, time_limit=args.time_limit, **options))
    rows = {name: {"setting": DDP_TIME, "method": name, "budget_bytes": peak if name != "eager" else None}
            for name in runs}
    for name, (m, wrapped, fn) in runs.items():
        t0 = time.perf_counter()
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            _step(fn, inputs)
        rows[name]["warm_up_s"] = round(time.perf_counter() - t0, 1)  # (fxopt's: capture, plan, compile)
        m.zero_grad(set_to_none=True)
        measured = fxopt.measure_peak(_step, fn, inputs, resident=[fn, wrapped, m])
        rows[name].update(peak_bytes=measured.peak_bytes, grads=_grads(m),
                          loss=_mean_over_ranks(float(measured.result), device))
        m.zero_grad(set_to_none=True)
        rows[name]["order"] = issue_order(fn, m, inputs, f"{args.trace}/{_slug(name)}_rank{rank}.json"
                                          if args.trace else None)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.timed_steps):
        for name, (m, _, fn) in runs.items():
            m.zero_grad(set_to_none=True)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            _step(fn, inputs)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    for name, row in rows.items():
        row.update(step_s=statistics.median(wall[name]), cpu_s=statistics.median(cpu[name]),
                   **(_plan_fields(runs[name][2]) if name != "eager" else {}))
        _compare(row, {}, single)
    return list(rows.values())


def _slug(method: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in method).strip("_")


def issue_order(fn, model: nn.Module, inputs, trace: str | None = None) -> dict[str, Any]:
    """One profiled step of ``fn``: its gradients' all-reduces (gloo's, on gloo's own thread)
    against its backward, in ms from the backward's start (the first event of autograd's engine or
    of a compiled backward) to its end (the last such event's end): how many all-reduces started
    before the backward ended, the first's start and the last's end. ``trace``: the profile, in
    Chrome's format, written there."""
    from torch.profiler import profile

    with profile() as prof:
        _step(fn, inputs)
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    events = prof.events()
    backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")
                or e.name == "CompiledFunctionBackward"]
    reduces = sorted((e for e in events if e.name == "gloo:all_reduce"), key=lambda e: e.time_range.start)
    if not backward or not reduces:
        return {"all_reduces": len(reduces)}
    start = min(e.time_range.start for e in backward)
    end = max(e.time_range.end for e in backward)
    ms = lambda t: round((t - start) / 1e3, 2)  # noqa: E731 - the profiler's µs as ms from the backward's start
    return {"all_reduces": len(reduces), "started_in_backward": sum(e.time_range.start < end for e in reduces),
            "backward_ms": ms(end), "first_start_ms": ms(reduces[0].time_range.start),
            "last_end_ms": ms(max(e.time_range.end for e in reduces))}


def run_setting(setting: str, args, rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Every row of one setting on this rank (the fxopt rows' budgets agreed over the ranks)."""
    if setting == DDP_TIME:
        return interleaved_ddp(args, rank, world, device)
    rows: list[dict[str, Any]] = []

    single = single_process(args, world, device)

    def attempt(method: str, budget: int | str | None = None) -> dict[str, Any]:
        model, inputs = build(args.size, world, rank, device, args.model)
        blocks = blocks_of(model)
        wrapped = _wrap(setting, model, device, one_graph=method.startswith(FULLY_SHARD))
        row: dict[str, Any] = {"setting": setting, "method": method, "budget_bytes": budget}
        t0 = time.perf_counter()
        try:
            if method == "eager":
                fn = wrapped
            elif method == "checkpoint":
                fn = checkpoint_blocks(wrapped, blocks)
            else:
                fn = fxopt.optimize(wrapped, budget, time_limit=args.time_limit, **_pricing(method))
            row.update(measure(fn, model, wrapped, inputs, args.timed_steps, device))
            if method.startswith("fxopt"):
                row.update(_plan_fields(fn))
                if args.plans and rank == 0:  # (the ranks run rank 0's plan: `fxopt.distributed.fsdp.agreed_plan`)
                    _write_plans(fn, args.plans, args.model, world, method)
        except fxopt.InfeasibleBudgetError as err:
            row["error"] = error_line(err)
            row["min_budget"] = err.min_budget
        except Exception as err:  # noqa: BLE001 - the row records it; the run goes on
            row["error"] = error_line(err)
            log(traceback.format_exc())
        row["elapsed_s"] = round(time.perf_counter() - t0, 1)
        del model, wrapped
        torch._dynamo.reset()
        rows.append(row)
        return row

    eager = attempt("eager")
    ckpt = attempt("checkpoint")
    budget = _agreed_max(ckpt.get("peak_bytes", 0), device)
    if setting == "fsdp":
        # FSDP2's own model, its step one graph (fxopt.distributed.fsdp); then the same step with
        # fxopt's own sharding (fxopt.distributed.fully_shard).
        for form in (FORMS[f] for f in args.forms.split(",")):
            attempt(f"{form}@checkpoint", budget)
            attempt(f"{form}@min", "min")
            if args.backend != "nccl" and args.nccl_priced:
                attempt(f"{form}@checkpoint{NCCL_PRICED}", budget)
    else:
        row = attempt("fxopt@checkpoint", budget)
        for _ in range(args.retries):
            # Every rank plans the same step; the largest budget any rank names is tried by all.
            need = _agreed_max(row.get("min_budget", 0), device)
            if not need:
                break
            row = attempt("fxopt@min", need)
        if eager.get("peak_bytes"):
            # fxopt at eager's peak (nothing to recompute): its step time beside eager DDP's, the
            # gradients' all-reduces in fxopt's graph (fxopt.distributed.ddp).
            attempt("fxopt@eager", _agreed_max(eager["peak_bytes"], device))
    for r in rows:
        _compare(r, eager, single)
    return rows


def _pricing(method: str) -> dict[str, Any]:
    """fxopt's options for a row's pricing: communication at NCCL's rate for an `NCCL_PRICED` row."""
    if not method.endswith(NCCL_PRICED):
        return {}
    from fxopt.analysis.costs import COMM_BYTES_PER_SECOND, CostModel

    return {"cost_model": CostModel(comm_bytes_per_second=COMM_BYTES_PER_SECOND["nccl"])}


def _agreed_max(value: int, device: torch.device) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    held_for_gloo(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    held_for_gloo(t)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _compare(row: dict[str, Any], eager: dict[str, Any], single: dict[str, Any]) -> None:
    """The row's loss (mean over ranks) and gradients against single-process eager's on the whole
    batch (torch.testing's float32 tolerance); its FLOPs against this setting's eager row."""
    grads = row.pop("grads", None)
    if grads is None:
        return
    ref = single["grads"]
    row["loss_diff"] = abs(row["loss"] - single["loss"])
    try:
        torch.testing.assert_close(torch.tensor(row["loss"]), torch.tensor(single["loss"]))
        assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], msg=lambda m: f"{name}: {m}")
        row["grads_equal"] = True
    except AssertionError as err:
        row["grads_equal"] = False
        row["grads_error"] = str(err).splitlines()[0]
    if eager.get("flops") is not None and row.get("flops") is not None:
        row["extra_flops"] = row["flops"] - eager["flops"]


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("FXOPT_CACHE", "0")  # a cached plan would report another run's planning time
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    try:
        for setting in args.settings.split(","):
            rows += run_setting(setting, args, rank, world, device)
    finally:
        dist.destroy_process_group()
    for r in rows:
        r.pop("grads", None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ report


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (setting, method): the largest peak and step time over the ranks."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in ("peak_bytes", "step_s", "cpu_s", "loss_diff"):
            values = [r[key] for r in rows if r.get(key) is not None]
            row[key] = max(values) if values else None
        row["grads_equal"] = all(r.get("grads_equal", True) for r in rows) if "grads_equal" in row else None
        row["errors"] = sorted({r["error"] for r in rows if r.get("error")})
        row.pop("error", None)
        merged.append(row)
    return merged


def _mib(n) -> str:
    return "–" if n is None else f"{n / MiB:.2f}"


def _gflop(n) -> str:
    return "–" if n is None else f"+{n / 1e9:.3f}"


def _ddp_time_note(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """A ddp-time row's step against eager DDP's, and its all-reduces against its backward (rank 0's
    profiled step, `issue_order`)."""
    out = []
    if row["method"] != "eager":
        base = next(e for e in rows if e["setting"] == DDP_TIME and e["method"] == "eager")
        out.append(f"× eager DDP: {row['step_s'] / base['step_s']:.3f} wall, {row['cpu_s'] / base['cpu_s']:.3f} CPU")
    order = row.get("order") or {}
    if order.get("backward_ms") is not None:
        out.append(f"rank 0's profiled step: {order['started_in_backward']} of {order['all_reduces']} all-reduces "
                   f"started before its backward ended (the first at {order['first_start_ms']} ms of a "
                   f"{order['backward_ms']} ms backward, the last ended at {order['last_end_ms']} ms)")
    elif order:
        out.append(f"rank 0's profiled step: {order['all_reduces']} all-reduces, no backward seen")
    return out


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    out = report_head(
        "fxopt under DDP and FSDP2 against per-block checkpointing", meta,
        f"transformers {meta.get('transformers')} · {meta['world']} processes, {meta['backend']} on {meta['device']}",
        f"size {meta['size']!r} ({meta['model']}) · fxopt time limit {meta['time_limit']} s",
        f"{meta['timed_steps']} timed steps · load before: `{meta.get('load_before', meta.get('load'))}`, after: "
        f"`{meta.get('load_after')}` · {'complete' if meta.get('complete') else 'incomplete'}, {meta.get('elapsed_s')} s"
    ) + [
        "Per-rank peak: the largest over the ranks, in MiB, measured by `fxopt.measure_peak` over the third step "
        "(parameters, gradients, inputs, DDP's buckets and FSDP2's shards and buffers included). Extra GFLOP: "
        "counted over one step, above eager's. Step: the median step time, the largest over the ranks (CPU "
        "timings on a shared machine are noisy: see the load). Checkpointing: each decoder layer's forward under "
        "`torch.utils.checkpoint` (non-reentrant). fxopt@checkpoint: that row's measured peak as fxopt's budget, in "
        "bytes; fxopt@min: the smallest budget fxopt named when that one did not fit (`min`: fxopt's smallest "
        "budget, `\"min\"`); fxopt@eager (DDP): eager's measured peak as the budget (nothing to recompute). "
        f"{FSDP2_ONE_GRAPH}: fxopt.optimize of FSDP2's model, its step one graph (fxopt.distributed.fsdp2); "
        f"{FULLY_SHARD}: the model sharded with fxopt.distributed.fully_shard instead; {NCCL_PRICED.strip()}: "
        "planned with communication priced at NCCL's rate (100 GB/s, not gloo's 1 GB/s: the plan a GPU would get), "
        "run here. Ratio: fxopt's extra FLOPs / "
        "checkpointing's (target ≤ 0.5). CPU s (setting ddp-time only, its steps interleaved round by round): the "
        "median CPU seconds of a step, the largest over the ranks. Grads equal: on every rank, the loss (its mean over the ranks) and every "
        "gradient equal single-process eager's on the whole batch (the gradient of its mean loss), within "
        "torch.testing's float32 tolerance.",
        "",
        "| setting | method | budget MiB | per-rank peak MiB | extra GFLOP | ratio | step s | CPU s | plans | grads equal | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    ckpt_extra, ckpt_peak = {}, {}
    for r in data["rows"]:
        if r["method"] == "checkpoint":
            ckpt_extra[r["setting"]] = r.get("extra_flops")
            ckpt_peak[r["setting"]] = r.get("peak_bytes")
    for r in data["rows"]:
        ratio = "–"
        ref = ckpt_extra.get(r["setting"])
        if r["method"].startswith("fxopt") and r.get("extra_flops") is not None and ref:
            ratio = f"{r['extra_flops'] / ref:.2f}"
        within = ""
        if r["method"].startswith("fxopt") and r.get("peak_bytes") is not None:
            planned = r.get("planned_budget_bytes") if r["budget_bytes"] == "min" else r["budget_bytes"]
            within = "within budget" if planned and r["peak_bytes"] <= planned else "**over budget**"
            if r["budget_bytes"] == "min":
                share = f" = {planned / ckpt_peak[r['setting']]:.2f}× checkpointing's peak" if ckpt_peak.get(r["setting"]) else ""
                within += f" (the smallest budget: planned {_mib(planned)} MiB{share})"
            if r.get("regathered_bytes"):
                within += f"; {_mib(r['regathered_bytes'])} MiB re-gathered (communication, not in GFLOP)"
            if r.get("comm_wait_ms"):
                within += (f"; waits for communication {r['comm_wait_ms']:.2f} ms simulated (gradient reductions "
                           f"{r['reduce_wait_ms']:.2f})")
            gaps = [g for g in r.get("gaps") or [] if g is not None]
            if gaps:
                within += f"; {', '.join(r.get('statuses', []))}, gap {max(gaps):.1%} to its proven bound"
        unequal = [f"not equal: {r['grads_error']}"] if r.get("grads_equal") is False and r.get("grads_error") else []
        note = "; ".join([*([within] if within else []), *unequal, *r.get("errors", [])])
        step = "–" if r.get("step_s") is None else f"{r['step_s']:.3f}"
        cpu = "–" if r.get("cpu_s") is None else f"{r['cpu_s']:.4f}"
        if r["setting"] == DDP_TIME:
            note = "; ".join([*_ddp_time_note(r, data["rows"]), *([within] if within else []), *unequal, *r.get("errors", [])])
        grads = {True: "yes", False: "**no**", None: "–"}[r.get("grads_equal")]
        out.append(f"| {r['setting']} | {r['method']} | {_mib(r.get('budget_bytes')) if r.get('budget_bytes') != 'min' else 'min'} | {_mib(r.get('peak_bytes'))} | "
                   f"{_gflop(r.get('extra_flops'))} | {ratio} | {step} | {cpu} | {r.get('plans', '–')} | {grads} | {note} |")
    out += ["", "## GPU", "", meta.get("gpu_note", ""), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated: {', '.join(SETTINGS)}, and {DDP_TIME} (eager DDP and fxopt at eager's "
                             "peak, steps interleaved: wall and CPU seconds)")
    parser.add_argument("--forms", default=",".join(FORMS),
                        help="the FSDP forms fxopt plans: fsdp2 (FSDP2's model), fully_shard (fxopt's own)")
    parser.add_argument("--nccl-priced", action=argparse.BooleanOptionalAction, default=True,
                        help="on gloo, also each form at checkpointing's peak planned with communication priced at "
                             "NCCL's rate (the plan a GPU would get), counted and measured here")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's safety stop, seconds (default: fxopt's); counted effort decides the plan")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", default="benchmarks/results/data_parallel")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help=f"{DDP_TIME}: write each row's profiled step (rank by rank) into DIR, in Chrome's trace format")
    parser.add_argument("--plans", default=None, metavar="DIR",
                        help="write each fxopt row's plans (rank 0's, the one every rank runs) as JSON into DIR, their "
                             "solver graphs included: python -m benchmarks.regather_tradeoff reads one")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.data_parallel", *(shlex.quote(a) for a in argv)])
    meta = run_meta(command)
    import transformers

    meta.update({"transformers": transformers.__version__, "world": args.world, "backend": args.backend,
                 "device": args.device, "size": args.size, "model": f"{CLASSES[args.model]} " + json.dumps(SIZES[args.size]),
                 "time_limit": args.time_limit, "timed_steps": args.timed_steps})
    gpu = ("python -m benchmarks.data_parallel --device cuda --backend nccl --world 1 "
           "--out benchmarks/results/data_parallel_gpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        meta["gpu_note"] = f"Not run: no CUDA device on this machine. The GPU row's command: `{gpu}`."
        meta["complete"] = False
        data = {"meta": meta, "rows": []}
        write_results(out, data, report(data))
        log(meta["gpu_note"])
        return
    meta["gpu_note"] = ("This run is on CUDA." if args.device == "cuda" else
                        f"Not run here (no CUDA device on this machine); with one GPU: `{gpu}` (world size 1 on "
                        "NCCL still runs DDP's reducer and FSDP2's collectives).")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.world, _free_port(), args, tmp), nprocs=args.world, join=True,
                           start_method="spawn")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    meta.update({"elapsed_s": round(time.perf_counter() - t0, 1), "load_after": load_average(), "complete": True})
    data = {"meta": meta, "rows": merge(per_rank), "per_rank": per_rank}
    write_results(out, data, report(data))
    log(report(data))


if __name__ == "__main__":
    main()
