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


def best_policy(plan: Any) -> dict[str, Any]:
    """The cheapest simple policy within the plan's budget on its graph (`fxopt.solvers.policies`:
    per-block checkpointing, torch's selective default, nothing), by the cost the solvers minimise
    (`Timeline.cost`: FLOPs, per-op overhead and exposed transfers, so a recomputed pointwise op is
    not free): its name (None where none fits), peak, extra FLOPs and cost; {} at a commit before
    the policies existed."""
    try:
        from fxopt.solvers.policies import named_policy_candidates
    except ImportError:
        return {}
    fitting = [(timeline.cost, name, timeline) for name, (_, timeline) in named_policy_candidates(plan.graph)
               if timeline.peak_bytes <= plan.budget_bytes]
    if not fitting:
        return {"best_policy": None}
    cost, name, timeline = min(fitting, key=lambda f: (f[0], f[1]))
    return {"best_policy": name, "best_policy_peak_bytes": timeline.peak_bytes,
            "best_policy_extra_flops": timeline.recompute_flops, "best_policy_cost": cost}


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

    def attempt(self, row: dict[str, Any], build: Callable[[], Any], *, ctx: Callable[[], Any] | None = None,
                after_warmup: Callable[[Any, dict], None] | None = None) -> dict[str, Any]:
        """`measure` inside ``ctx()`` (when given), recording what stops the row instead of raising:
        ``infeasible`` (with the budget and fxopt's ``min_budget_bytes``) or the ``error``; and
        ``row_s``, the seconds the row took. One failing row does not stop a benchmark."""
        t0 = time.perf_counter()
        try:
            with (ctx() if ctx is not None else contextlib.nullcontext()):
                self.measure(row, build, after_warmup=after_warmup)
        except fxopt.InfeasibleBudgetError as err:
            row.update({"infeasible": True, "budget_bytes": err.budget, "min_budget_bytes": err.min_budget})
        except Exception as err:  # noqa: BLE001 - one failing row must not stop the others
            row["error"] = error_line(err)
            log(traceback.format_exc(limit=4))
        torch._dynamo.reset()
        row["row_s"] = round(time.perf_counter() - t0, 2)
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


# ---- the run's context and its files ---------------------------------------------------------
# Every script writes its results through `write_results`, with `run_meta` as the "meta" of its
# JSON: one format, one key per fact. Files written before this (whose commit key was "git", or
# which had no "meta") stay readable through `commit_of`.


def run_meta(command: str, **extra: Any) -> dict[str, Any]:
    """Where and when a benchmark ran: command, date, commit (`commit`), versions, machine and
    its load average as the run starts (a shared machine: timings need it beside them). ``extra``:
    the script's own settings, added as they are."""
    meta = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        "fxopt": fxopt.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load": load_average(),
    }
    if torch.cuda.is_available():
        meta["cuda_device"] = torch.cuda.get_device_name()
    meta.update(extra)
    return meta


def commit() -> str:
    """The commit fxopt was loaded from, and whether fxopt/ or benchmarks/ had uncommitted
    changes: the one place a benchmark asks git."""
    root = Path(fxopt.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "fxopt", "benchmarks"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in fxopt/ or benchmarks/" if dirty else "")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def commit_of(meta: dict[str, Any]) -> str:
    """The commit a results file names, under either key it was written with ("git" before)."""
    return meta.get("commit") or meta.get("git") or "unknown"


def meta_line(meta: dict[str, Any]) -> str:
    """The line under a report's title: command, date, commit, torch, load."""
    load = f" · load {meta['load']}" if meta.get("load") else ""
    return f"`{meta['command']}` · {meta['date']} · commit {commit_of(meta)} · torch {meta['torch']}{load}"


def saved_settings() -> tuple[int, str | None]:
    """The process-wide settings a run changes (torch's CPU threads, ``FXOPT_CACHE``), to give
    back to `restore_settings` when it ends: the benchmarks also run inside tests."""
    return torch.get_num_threads(), os.environ.get("FXOPT_CACHE")


def restore_settings(saved: tuple[int, str | None]) -> None:
    threads, cache = saved
    torch.set_num_threads(threads)
    if cache is None:
        os.environ.pop("FXOPT_CACHE", None)
    else:
        os.environ["FXOPT_CACHE"] = cache


def report_head(title: str, meta: dict[str, Any], *details: str) -> list[str]:
    """A report's first lines: its title, then `meta_line` and the script's ``details``."""
    return [f"# {title}", "", " · ".join((meta_line(meta), *details)), ""]


def run_to_end(run_class: Callable[[Any], Any], args: Any, argv: Sequence[str] | None, wrote: str) -> Any:
    """A benchmark's `Run` built from ``args`` (``args.argv``: the command line it was given) and
    executed, torch's UserWarnings off; logs how long it took and ``wrote``."""
    args.argv = sys.argv[1:] if argv is None else list(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    run = run_class(args)
    run.execute()
    log(f"done in {time.perf_counter() - run.t0:.0f} s; wrote {wrote}")
    return run


def write_results(path: Path | str, data: dict[str, Any], markdown: str) -> Path:
    """``<path>.json`` (``data``, with its "meta" from `run_meta`) and ``<path>.md`` (``markdown``),
    folders made; returns the Markdown's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / f"{path.name}.json").write_text(json.dumps(data, indent=1, default=str))
    md = path.parent / f"{path.name}.md"
    md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return md


def choose(text: str | None, known: Sequence[str], what: str = "") -> tuple[str, ...]:
    """The comma-separated names in ``text`` (all of ``known`` when empty); an unknown name
    stops the run with the list to choose from."""
    if not text:
        return tuple(known)
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what + ' ' if what else ''}{', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def mib(n: int | float | None) -> str:
    return "–" if n is None else f"{n / MiB:.2f}"


def error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def run_rows(command: str, names: list[str], row_of: Callable[[str], dict], out: Path | str,
             markdown: Callable[[dict], str], brief: Callable[[dict], Any] = lambda row: row) -> dict:
    """One row per name (``row_of(name)``; a model that raises is a row with its error, and the
    run goes on), written with `write_results` (``markdown(result)`` its report) after every row.
    ``brief``: what the log shows of a row."""
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
        write_results(out, result, markdown(result))
    return result


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
