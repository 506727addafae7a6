"""OFFLOAD on a GPT-2-style model: does the budget hold, what does the plan cost in step time, and
how does it compare with offloading everything?

    python -m benchmarks.offload [--device cuda] [--fractions 0.3,0.5] [--out benchmarks/results]
    python -m benchmarks.offload --dry-run      # CPU, a tiny GPT-2: the code paths, in a minute

Model: `fxopt.models.gpt2` (4 layers, width 768, 12 heads, sequence 512, batch 8, fp32, dropout
0.1; ``--dry-run``: 2 layers, width 64, sequence 64, batch 4). Budget at fraction f of the
**activations**: ``base + f * (eager peak - base)``, where ``base`` is what any step holds
(parameters, buffers, inputs and the parameters' gradients) and the eager peak is the one fxopt
predicts. Methods, each from no gradients and the same seed:

- ``eager``: the reference (peak, step time, gradients);
- ``fxopt+offload``: `fxopt.optimize(model, budget, offload=True)`;
- ``fxopt``: the best plan without OFFLOAD (``offload=False``) at that budget, or, where none
  fits, at the smallest budget fxopt reaches without it (``budget_bytes`` says which);
- ``same schedule, no copies``: the offload plan with its OFFLOADed values SAVEd instead (above
  the budget): the step's compute alone, so that ``measured exposed`` = step time of
  ``fxopt+offload`` minus this one's;
- ``offload-all hooks``: torchtune-style ``saved_tensors_hooks`` copying every saved activation
  (parameters excepted) to pinned host memory on a side stream, copied back on first use;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.

Per row: measured peak (``torch.cuda.max_memory_allocated`` through `fxopt.measure_peak`; the
profiler's allocation events on CPU), whether it is within the budget, on CUDA the reserved peak
(``max_memory_reserved`` after ``empty_cache``: an offloaded tensor leaves the allocated count when
the forward drops it, while its block is reused only once its copy completes), median step time of
``--timed-steps`` steps, gradients against eager's, and for fxopt's plans the predicted peak,
host bytes and predicted exposed transfer time. On CPU (the dry run) host and device are the
same memory, so the peaks say nothing about OFFLOAD there: the dry run checks that every method
runs and writes its row. Writes ``<out>/offload_<device>.md`` and ``.json``; every row is written
as soon as it is measured, and no row starts after ``--deadline`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import time
import warnings
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import commit_of, median_step_seconds, run_meta, write_results
from fxopt.models import gpt2, loss_of
from fxopt.solvers import SolverTimeoutWarning
from fxopt.solvers.plan import Plan
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

MiB = 2**20
SIZES = {"full": dict(layers=4, dim=768, heads=12, seq=512, batch=8),
         "dry-run": dict(layers=2, dim=64, heads=4, seq=64, batch=4, vocab=512)}


def train_step(model, inputs) -> torch.Tensor:
    torch.manual_seed(0)
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss.detach()


class OffloadAllHooks(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's ``OffloadActivations``, reduced: every saved tensor that is not a parameter
    goes to a fresh pinned host buffer on a side stream (its device memory is reused once the
    copy completes), and comes back on the compute stream when the backward unpacks it."""

    def __init__(self, model: torch.nn.Module):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() in params or t.numel() == 0:
                return t
            if t.device.type != "cuda":
                return ("host", t.clone(), None)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            return ("host", host, (t.device, stream.record_event()))

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            _, host, where = packed
            if where is None:
                return host
            device, copied = where
            torch.cuda.current_stream().wait_event(copied)
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


class Hooked(torch.nn.Module):
    """``model`` with every step run inside ``context()``."""

    def __init__(self, model: torch.nn.Module, context):
        super().__init__()
        self.model, self.context = model, context

    def forward(self, *args):
        with self.context():
            return self.model(*args)


def activation_budget(model, inputs, fraction: float, device) -> tuple[int, int, int]:
    """(budget, eager's predicted peak, base): see the module docstring."""
    eager_peak = fxopt.plan(model, 1.0, inputs, offload=False, solver="save_all").eager_peak_bytes
    tensors = [*model.parameters(), *model.buffers(), *[t for t in inputs if isinstance(t, torch.Tensor)]]
    base = sum(t.numel() * t.element_size() for t in tensors)
    base += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return int(base + fraction * (eager_peak - base)), eager_peak, base


def without_copies(plan: Plan) -> Plan:
    """``plan``'s schedule with its OFFLOADed values SAVEd on the device instead."""
    schedule = dataclasses.replace(plan.schedule, offloaded=frozenset(), reload_at=())
    return Plan.build(graph=plan.graph, schedule=schedule, budget_bytes=plan.budget_bytes,
                      eager_peak_bytes=plan.eager_peak_bytes, solver=plan.solver + " (no copies)",
                      status=plan.status, solve_seconds=0.0, fingerprint=plan.fingerprint,
                      module_paths=plan.module_paths)



def measure(row: dict, model, inputs, reference: list, args, device) -> dict:
    """Fill ``row`` for ``model`` (built, not yet run): warm-up, peak, gradients, step time."""
    train_step(model, inputs)  # warm-up: compiles, plans, allocates the host arena
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":  # so that the reserved peak is this step's, not earlier methods' cache
        gc.collect()
        torch.cuda.empty_cache()
    peak = fxopt.measure_peak(train_step, model, inputs, resident=[model, inputs], device=device)
    grads = [p.grad for p in model.parameters()]
    row["measured_peak_bytes"] = peak.peak_bytes
    if device.type == "cuda":
        # An offloaded tensor leaves the allocated count when the forward drops it, but its block
        # is reused only once its copy completes (record_stream): the reserved peak shows that.
        row["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
    if "budget_bytes" in row:
        row["within_budget"] = peak.peak_bytes <= row["budget_bytes"]
    if reference:
        row["grads_equal"] = len(grads) == len(reference) and all(
            (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-4, atol=1e-5))
            for a, b in zip(grads, reference))
    row["step_s"] = median_step_seconds(lambda: train_step(model, inputs), model, args.timed_steps, device)
    return row


def plan_fields(plan: Plan) -> dict:
    return dict(predicted_peak_bytes=plan.peak_bytes, offloaded=len(plan.offloaded), host_bytes=plan.host_bytes,
                predicted_exposed_s=plan.exposed_transfer_seconds, recompute_cost_s=plan.recompute_cost,
                solver=f"{plan.solver} ({plan.status})", budget_bytes=plan.budget_bytes)


def rows_for_fraction(fraction: float, model, inputs, reference: list, args, device, write) -> None:
    """Every method at one fraction of the activations; each row written as soon as measured."""
    budget, eager_peak, base = activation_budget(model, inputs, fraction, device)
    common = dict(fraction=fraction, budget_bytes=budget)
    opts = dict(time_limit=args.time_limit)

    def run(method: str, build) -> dict:
        row = dict(common, method=method)
        if time.perf_counter() > args.started + args.deadline:
            row["error"] = "skipped: past the deadline"
            return write(row)
        try:
            built, extra = build()
            row.update(extra)
            measure(row, built, inputs, reference, args, device)
        except Exception as err:  # noqa: BLE001 - a failing method is a row, the run goes on
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return write(row)

    planned = {}

    def fxopt_offload():
        m = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, offload=True, **opts)
        planned["offload"] = m.plan
        return m, plan_fields(m.plan)

    offloaded = run("fxopt+offload", fxopt_offload)

    def fxopt_no_offload():
        try:
            m = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, offload=False, **opts)
        except fxopt.InfeasibleBudgetError as err:
            m = fxopt.optimize(copy.deepcopy(model), err.min_budget, example_inputs=inputs, offload=False, **opts)
        return m, dict(plan_fields(m.plan), budget_bytes=budget, plan_budget_bytes=m.plan.budget_bytes)

    run("fxopt", fxopt_no_offload)

    def same_schedule():
        plan = without_copies(planned.get("offload") or fxopt.plan(model, budget, inputs, offload=True, **opts))
        return fxopt.optimize(copy.deepcopy(model), budget, plan=plan, offload=True), plan_fields(plan)

    compute_only = run("same schedule, no copies", same_schedule)
    if "step_s" in offloaded and "step_s" in compute_only:
        offloaded["measured_exposed_s"] = offloaded["step_s"] - compute_only["step_s"]
        write(offloaded, replace=True)
    def offload_all():
        m = copy.deepcopy(model)
        return Hooked(m, lambda: OffloadAllHooks(m)), {}

    run("offload-all hooks", offload_all)
    pin = device.type == "cuda"
    run("save_on_cpu", lambda: (Hooked(copy.deepcopy(model),
                                       lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)), {}))


class Results:
    """The rows so far, written to ``<out>/offload_<name>.json`` and ``.md`` after each row."""

    def __init__(self, out: Path, name: str, meta: dict):
        self.path = out / f"offload_{name}"
        self.meta, self.rows = meta, []

    def write(self, row: dict, replace: bool = False) -> dict:
        if not replace:
            self.rows.append(row)
        self.md = write_results(self.path, {"meta": self.meta, "rows": self.rows}, report(self.meta, self.rows))
        return row


def report(meta: dict, rows: list[dict]) -> str:
    """The Markdown table of ``rows``."""

    def mib(key):
        return lambda r: f"{r[key] / MiB:.1f}" if key in r else "–"

    def ms(key):
        return lambda r: f"{r[key] * 1e3:.2f}" if key in r else "–"

    columns = [("fraction", lambda r: f"{r['fraction']:.0%}" if "fraction" in r else "–"), ("method", lambda r: r["method"]),
               ("budget MiB", mib("budget_bytes")), ("measured peak MiB", mib("measured_peak_bytes")),
               ("within", lambda r: {True: "yes", False: "**NO**"}.get(r.get("within_budget"), "–")),
               ("reserved peak MiB", mib("reserved_peak_bytes")),
               ("predicted peak MiB", mib("predicted_peak_bytes")), ("step ms", ms("step_s")),
               ("vs eager", lambda r: f"{r['step_s'] / meta['eager_step_s']:.2f}×" if "step_s" in r else "–"),
               ("offloaded", lambda r: str(r.get("offloaded", "–"))), ("host MiB", mib("host_bytes")),
               ("exposed ms predicted", ms("predicted_exposed_s")), ("exposed ms measured", ms("measured_exposed_s")),
               ("grads", lambda r: {True: "equal", False: "**DIFFER**"}.get(r.get("grads_equal"), "–")),
               ("note", lambda r: r.get("error", "") or (f"planned at {r['plan_budget_bytes'] / MiB:.1f} MiB"
                                                         if r.get("plan_budget_bytes", r.get("budget_bytes")) != r.get("budget_bytes") else ""))]
    lines = [f"# OFFLOAD on GPT-2 ({meta['size']}), {meta['device']}", "",
             f"`{meta['command']}` — {meta['date']}, commit {commit_of(meta)}, torch {meta['torch']}, {meta['device_name']}.",
             f"Model {meta['model']}; eager peak (predicted) {meta['eager_peak_bytes'] / MiB:.1f} MiB, of which "
             f"{meta['base_bytes'] / MiB:.1f} MiB parameters, inputs and gradients; eager step {meta['eager_step_s'] * 1e3:.2f} ms "
             f"(measured peak {meta['eager_measured_peak_bytes'] / MiB:.1f} MiB). Bandwidths planned with: {meta['transfers']}.",
             "", "| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f(r) for _, f in columns) + " |" for r in rows]
    if meta["device"] == "cpu":
        lines += ["", "CPU dry run: host and device are the same memory, so these peaks and times say nothing "
                      "about OFFLOAD; the run checks that every method runs and writes its row."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny GPT-2: check the code paths")
    p.add_argument("--fractions", default="0.3,0.5")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    p.add_argument("--timed-steps", type=int, default=5)
    p.add_argument("--deadline", type=float, default=390.0, help="seconds after which no row starts")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    args.started = time.perf_counter()
    if args.dry_run:
        args.device, args.time_limit, args.timed_steps = "cpu", min(args.time_limit, 3.0), min(args.timed_steps, 2)
    device = torch.device(args.device)
    size = "dry-run" if args.dry_run else "full"
    torch.manual_seed(0)
    model, inputs = gpt2(**SIZES[size])
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    with warnings.catch_warnings(), _no_plan_cache():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        eager = copy.deepcopy(model)
        eager_row = measure({"method": "eager"}, eager, inputs, [], args, device)
        reference = [q.grad for q in eager.parameters()]
        _, eager_peak, base = activation_budget(model, inputs, 1.0, device)
        transfers = fxopt.plan(model, 1.0, inputs, offload=True, solver="save_all").graph.transfers
        meta = run_meta(
            "python -m benchmarks.offload " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            size=size, model=SIZES[size], device=device.type,
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            eager_peak_bytes=eager_peak, base_bytes=base, eager_step_s=eager_row["step_s"],
            eager_measured_peak_bytes=eager_row["measured_peak_bytes"],
            transfers=f"{transfers.d2h_bytes_per_s / 1e9:.1f} GB/s to host, {transfers.h2d_bytes_per_s / 1e9:.1f} GB/s to device")
        results = Results(Path(args.out), "dry_run_cpu" if args.dry_run else device.type, meta)
        results.write(eager_row)
        for fraction in (float(f) for f in args.fractions.split(",")):
            rows_for_fraction(fraction, model, inputs, reference, args, device, results.write)
    print(results.md.read_text())
    return 0


@contextlib.contextmanager
def _no_plan_cache():
    """Fresh solves: a plan cached by an earlier run would hide the planning time."""
    import os

    saved = os.environ.get("FXOPT_CACHE")
    os.environ["FXOPT_CACHE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FXOPT_CACHE"]
        else:
            os.environ["FXOPT_CACHE"] = saved


if __name__ == "__main__":
    raise SystemExit(main())
