"""How the benchmarks measure one training step: the same way for every method.

`Measurer` holds one model and its inputs (shared by every method, so parameters and inputs are
the same bytes everywhere) and eager's reference step. ``Measurer.measure(row, build)`` builds a
method (``build()`` returns a callable used like the model), runs one untimed warm-up step (which
compiles and plans), then fills ``row`` with:

- ``measured_peak_bytes``: `fxopt.measure_peak` of one forward+backward with
  ``model.zero_grad(set_to_none=True)`` just before it (outside the measured step) and the model
  and inputs resident: parameters + inputs + gradients + everything allocated during the step.
  On CPU from the profiler's allocation events (which also see Inductor's code), on CUDA from
  ``torch.cuda.max_memory_allocated``;
- ``grads_equal``: that step's gradients against eager's (``torch.testing.assert_close``, default
  tolerances), and the loss difference;
- ``flops`` / ``extra_flops``: `fxopt.measure.count_flops` over one step (a dispatch mode with
  ``ignore_compile_internals() -> True``, so Dynamo runs the already compiled code under it rather
  than silently falling back to eager; FlopCounterMode's module hooks would break the capture).
  Inside Inductor's generated code it sees only the kernels Inductor calls through the dispatcher
  (matrix products and convolutions on CPU), not fused loops — which have no counted FLOPs anyway.
  ``recompiled_during_flops`` flags a recompilation during the count;
- ``step_s`` / ``step_ratio``: median of ``timed_steps`` steps, each paired with an eager step run
  just before it (interleaved, in one process), and the ratio of the medians to eager's.

Every step seeds the RNG first, so any random op draws the same numbers in every method.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
import torch.utils.checkpoint

import fxopt
from fxopt.measure import count_flops

MiB = 2**20
SEED = 0


def train_step(fn: Callable[..., torch.Tensor], inputs: Sequence[Any]) -> torch.Tensor:
    """One forward + backward of a model that returns its scalar loss."""
    torch.manual_seed(SEED)
    loss = fn(*inputs)
    loss.backward()
    return loss.detach()


def checkpoint_blocks(model: nn.Module, blocks: Sequence[nn.Module]) -> Callable[..., Any]:
    """``model`` with each of ``blocks`` run under ``torch.utils.checkpoint`` (non-reentrant), the
    way users checkpoint per layer. The blocks' ``forward`` is wrapped only during the call, so the
    shared model stays unchanged for the other methods."""

    @contextlib.contextmanager
    def wrapped() -> Iterator[None]:
        for block in blocks:
            original = block.forward

            def forward(*args, _original=original, **kwargs):
                return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False, **kwargs)

            block.forward = forward
        try:
            yield
        finally:
            for block in blocks:
                del block.forward

    def run(*inputs):
        with wrapped():
            return model(*inputs)

    return run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_seconds(step: Callable[[], Any], model: nn.Module, steps: int, device: torch.device) -> float:
    """Median seconds of ``steps`` calls of ``step`` (after the caller's warm-up), ``model``'s
    gradients cleared before each and the device synchronized around it."""
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plan_fields(plan: Any) -> dict[str, Any]:
    """What a row records of an fxopt plan."""
    return {
        "fingerprint": plan.fingerprint,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.peak_bytes,
        "predicted_eager_peak_bytes": plan.eager_peak_bytes,
        "predicted_extra_flops": plan.recompute_flops,
        "plan_solver": plan.solver,
        "plan_status": plan.status,
        "solve_seconds": plan.solve_seconds,
        "n_saved": len(plan.saved),
        "n_recomputations": sum(plan.recomputed.values()),
        "graph_nodes": len(plan.graph),
    }


class Measurer:
    """One model and its inputs, eager's reference step, and `measure` for any method of running it."""

    def __init__(self, model: nn.Module, inputs: Sequence[Any], *, timed_steps: int = 5):
        self.model = model
        self.inputs = tuple(inputs)
        self.timed_steps = timed_steps
        self.device = next((t.device for t in self.model.parameters()), torch.device("cpu"))
        self.ref_grads: dict[str, torch.Tensor] = {}
        self.ref_loss: float | None = None
        self.eager_flops: int | None = None
        self.eager_peak: int | None = None

    # ---- eager's reference --------------------------------------------------------------------

    def set_reference(self) -> None:
        """Eager's loss and gradients (after one warm-up step), kept on the CPU so they do not
        count towards a CUDA peak."""
        model = self.model
        model.zero_grad(set_to_none=True)
        train_step(model, self.inputs)
        model.zero_grad(set_to_none=True)
        self.ref_loss = float(train_step(model, self.inputs))
        self.ref_grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters()
                          if p.grad is not None}
        model.zero_grad(set_to_none=True)

    def measure_eager(self, row: dict[str, Any]) -> dict[str, Any]:
        self.set_reference()
        self.measure(row, lambda: self.model)
        self.eager_flops = row["flops"]
        self.eager_peak = row["measured_peak_bytes"]
        row["extra_flops"] = 0
        return row

    # ---- one method ---------------------------------------------------------------------------

    def measure(self, row: dict[str, Any], build: Callable[[], Any], *, warmup_ctx: Callable[[], Any] | None = None,
                after_warmup: Callable[[Any, dict], None] | None = None) -> dict[str, Any]:
        """Build, warm up, then measure peak + gradients, FLOPs and step time into ``row``.
        Exceptions from building or the warm-up (e.g. `fxopt.InfeasibleBudgetError`) propagate,
        with ``row["first_call_s"]`` and ``row["notes"]`` filled."""
        model, inputs = self.model, self.inputs
        torch._dynamo.reset()
        gc.collect()
        model.zero_grad(set_to_none=True)
        row.setdefault("notes", [])
        fn: Any = None
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = build()
                with (warmup_ctx() if warmup_ctx is not None else contextlib.nullcontext()):
                    train_step(fn, inputs)
                synchronize(self.device)
            finally:
                row["first_call_s"] = time.perf_counter() - t0
                row["notes"].extend(sorted({
                    f"{w.category.__name__}: {str(w.message).splitlines()[0][:120]}" for w in caught
                    if "Timeout" in w.category.__name__ or w.category.__module__.startswith("fxopt")}))
        if after_warmup is not None:
            after_warmup(fn, row)

        # peak, and the gradients of that same step
        model.zero_grad(set_to_none=True)
        pm = fxopt.measure_peak(lambda *inp: train_step(fn, inp), *inputs, resident=[model], device=self.device)
        row["measured_peak_bytes"] = pm.peak_bytes
        row["measured_start_bytes"] = pm.start_bytes
        row["loss"] = float(pm.result)
        if self.ref_loss is not None:
            row["loss_abs_diff"] = abs(float(pm.result) - self.ref_loss)
        if self.ref_grads:
            row.update(compare_grads(model, self.ref_grads))
        if row.get("budget_bytes") is not None:
            row["within_budget"] = pm.peak_bytes <= row["budget_bytes"]

        # FLOPs
        model.zero_grad(set_to_none=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        row["flops"] = count_flops(train_step, fn, inputs)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
            row["recompiled_during_flops"] = True
            row["notes"].append("Dynamo recompiled during the FLOP count (count may be off)")
        if self.eager_flops is not None:
            row["extra_flops"] = row["flops"] - self.eager_flops

        # step time, interleaved with eager
        t_fn, t_eager = self.time_steps(fn)
        row["step_s"] = statistics.median(t_fn)
        row["eager_step_s_paired"] = statistics.median(t_eager)
        row["step_ratio"] = row["step_s"] / row["eager_step_s_paired"]
        row["step_ratio_min"] = min(t_fn) / min(t_eager)
        row["step_ratio_median_of_pairs"] = statistics.median(a / b for a, b in zip(t_fn, t_eager))
        row["step_times_s"] = t_fn
        row["eager_step_times_s"] = t_eager
        model.zero_grad(set_to_none=True)
        fn = None  # drop the compiled step before the next method
        torch._dynamo.reset()
        gc.collect()
        return row

    def time_steps(self, fn: Callable[..., Any]) -> tuple[list[float], list[float]]:
        """Seconds of ``fn``'s steps and of eager's, interleaved (eager then fn, n times)."""
        t_eager: list[float] = []
        t_fn: list[float] = []
        for _ in range(self.timed_steps):
            for f, out in ((self.model, t_eager), (fn, t_fn)):
                self.model.zero_grad(set_to_none=True)
                synchronize(self.device)
                t0 = time.perf_counter()
                train_step(f, self.inputs)
                synchronize(self.device)
                out.append(time.perf_counter() - t0)
        return t_fn, t_eager


def compare_grads(model: nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    ok, first_error, max_abs, max_rel = True, None, 0.0, 0.0
    for name, p in model.named_parameters():
        if name not in ref:
            continue
        if p.grad is None:
            ok, first_error = False, first_error or f"{name}: no gradient"
            continue
        grad = p.grad.detach().cpu()
        diff = (grad - ref[name]).abs()
        max_abs = max(max_abs, diff.max().item())
        max_rel = max(max_rel, (diff / ref[name].abs().clamp_min(1e-12)).max().item())
        try:
            torch.testing.assert_close(grad, ref[name])
        except AssertionError as err:
            ok = False
            first_error = first_error or f"{name}: " + " ".join(str(err).split())[:200]
    return {"grads_equal": ok, "grad_max_abs_diff": max_abs, "grad_max_rel_diff": max_rel,
            "grad_error": first_error}


# ---- the run's context ------------------------------------------------------------------------


def run_meta(command: str) -> dict[str, Any]:
    """Where and when a benchmark ran: command, date, versions, commit, machine."""
    meta = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "fxopt": fxopt.__version__,
        "git": git_state(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        meta["cuda_device"] = torch.cuda.get_device_name()
    return meta


def git_state() -> str:
    """The commit fxopt was loaded from, and whether fxopt/ or benchmarks/ had uncommitted changes."""
    root = Path(fxopt.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "fxopt", "benchmarks"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in fxopt/ or benchmarks/" if dirty else "")


def mib(n: int | float | None) -> str:
    return "–" if n is None else f"{n / MiB:.2f}"


def error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def run_rows(command: str, names: list[str], row_of: Callable[[str], dict], out: Path,
             write_markdown: Callable[[dict, Path], None], brief: Callable[[dict], Any] = lambda row: row) -> dict:
    """One row per name (``row_of(name)``; a model that raises is a row with its error, and the
    run goes on), ``<out>.json`` and ``<out>.md`` written after every row. ``brief``: what the log
    shows of a row."""
    result = {"meta": run_meta(command), "rows": []}
    for name in names:
        log(f"{command.split()[2]}: {name}")
        try:
            row = row_of(name)
        except Exception as err:  # noqa: BLE001 - a model that does not run is a row, and the run goes on
            log(traceback.format_exc())
            row = {"model": name, "error": error_line(err)}
        log(f"  {brief(row)}")
        result["rows"].append(row)
        Path(f"{out}.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, Path(f"{out}.md"))
    return result


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
