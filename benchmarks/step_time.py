"""Step time of fxopt against torch.compile and the usual ways to save memory, per model, side by
side in one process (issue 28).

    python -m benchmarks.step_time [--models hf-gpt2,hf-llama,hf-vit,hf-resnet] [--variants eager,compile,...]
        [--amb 0.25,0.5,0.75] [--steps 9] [--seq 256] [--batch 8] [--image-batch 8]
        [--out benchmarks/results/step_time]

Per model (`fxopt.models.MODELS`, transformers models of `benchmarks.hf_zoo` at "bench" size, text
at ``--seq`` tokens by ``--batch`` sequences, images ``--image-batch`` at a time; random weights,
dropout 0, one torch thread; ``--size test`` for a quick check), the variants (``--variants`` picks some, in this order):

- ``eager``: the model as is;
- ``compile``: ``torch.compile(model)``, Inductor with its defaults;
- ``fxopt-inductor@1.0``: ``fxopt.optimize(model, 1.0, compiler="inductor")``;
- ``fxopt-inductor@hf``: the same at HF gradient checkpointing's measured peak (bytes; a model
  without it, ResNet, has no such row);
- ``fxopt-inductor@hf-fused`` (only where ``--variants`` names it): ``fxopt-inductor@hf`` planned
  with a recomputed pointwise op priced as fused into its reader
  (``cost_model=CostModel(fused_pointwise=True)``: its FLOPs only, no memory traffic, a tenth of
  an op's overhead), so that the two pricings' plans are timed side by side (at `36e1c2e`, where
  the fused pricing was Inductor's default, the same pair ran as ``fxopt-inductor@hf`` and
  ``fxopt-inductor@hf-unfused``);
- ``fxopt-inductor@half``: the same at half of plain Inductor's activation memory: the
  ``compile`` row's measured peak less half its increase over what its step starts with
  (parameters and inputs), in bytes (needs the ``compile`` variant, measured first);
- ``compile-amb@X`` for each X of ``--amb``: ``torch.compile(model)`` compiled with
  ``torch._functorch.config.activation_memory_budget = X`` (torch's own partitioner trading
  recompute for memory; X is a share of the activations it saves, not of the peak);
- ``hf-ckpt-compile``: ``torch.compile`` of the model with HF's gradient checkpointing on, as a
  user gets it: transformers' ``kernels`` hub layers mutate a context variable in the forward, so
  Dynamo splits the step at every checkpointed layer and runs that layer eagerly (traced whole
  with `checkpoint_compiles`, at `e110481`, GPT-2 measured 40.65 MiB at 1.22x torch.compile and
  Llama 47.62 MiB at 1.26x: above HF's eager checkpointing peak);
- ``sac-compile``: ``torch.compile`` of the model with torchtitan-style selective activation
  checkpointing per layer: HF's checkpointing with torchtitan's ``SelectiveAC`` policy as its
  ``context_fn`` (`titan_selective_context`: save the outputs of the compute-intensive ops,
  recompute everything else and every second matrix product), each layer traced into the graph
  (`checkpoint_compiles`; split at every layer, its policy would run eagerly);
- ``fxopt-eager@1.0``: ``fxopt.optimize(model, 1.0)``, the eager compiler (FX code, op by op);
- ``fxopt-inductor-free@1.0`` (only where ``--variants`` names it): ``fxopt-inductor@1.0`` with
  Inductor's own fusion choices, memory reorder and buffer reuse (`FREE_FUSION`, as
  ``inductor_config``) where fxopt's plan is compiled: what the settings that keep fxopt's
  schedule cost, and whether the peak holds without them (its row's ``within``);
- ``aot-eager`` (only where ``--variants`` names it): ``torch.compile(model, backend="aot_eager")``,
  the same capture and AOTAutograd as the eager compiler's without fxopt's plan and bookkeeping.

Each variant steps its own deep copy of the model (the same weights), compiled through a code
object of its own (`fxopt.capture.compiled.own_frame`: no variant meets another's Dynamo cache
entries or recompile limit). Its first step compiles (and plans): its seconds are the row's
``compile s``. Then its peak (`fxopt.measure_peak`: parameters, inputs and gradients resident, the
profiler's allocation events, which see Inductor's code too) and its loss and gradients against
eager's (``rtol=1e-4, atol=1e-5``: Inductor sums in another order), and the Python function calls
one step makes (``Python calls``: counted, the Python beside the kernels). Then the timed steps, round
robin: each round steps every variant once, in an order rotated by one each round, gradients
cleared before each; a row's step time is the median of its ``--steps`` rounds (and its fastest),
and its ratios to eager's and to ``compile``'s are the medians of each round's ratio (the two
steps of a round run seconds apart, so the ratio holds where a shared machine's load drifts
between rounds; the ratio of the medians is in the JSON too). A recompile during the timed rounds is reported.
The load average is read as each model starts and ends. Inductor's and AOTAutograd's caches and
fxopt's plan cache are off for the run, and Inductor's compiled kernels go to a folder of the
run's own (``TORCHINDUCTOR_CACHE_DIR``), so every compile is made in it, none read from an earlier
run (a kernel one variant compiled, another may reuse; this is why a run takes minutes per model on a 2-core CPU: narrow it with ``--models`` and
``--variants``).

``--device cuda`` runs the same on a GPU (peaks from the allocator's statistics):
`benchmarks/gpu_step_time.sh`, prepared for a lent GPU, not run on one yet.

Writes ``<out>.json`` and ``<out>.md`` after every model.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config

import fxopt
from benchmarks import hf_zoo
from benchmarks.harness import (choose, error_line, load_average, log, mib, report_head, restore_settings, run_meta,
                                saved_settings, synchronize, train_step, write_results)
from fxopt.analysis import CostModel
from fxopt.capture.compiled import own_frame
from fxopt.capture.dynamo import unwrap_compile_error
from fxopt.measure import PeakMemory
from fxopt.models import MODELS

DEFAULT_MODELS = ("hf-gpt2", "hf-llama", "hf-vit", "hf-resnet")
DEFAULT_AMB = (0.25, 0.5, 0.75)
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
BASE_VARIANTS = ("eager", "compile", "fxopt-inductor@1.0", "fxopt-inductor-free@1.0", "fxopt-inductor@hf",
                 "fxopt-inductor@hf-fused", "fxopt-inductor@half", "compile-amb", "hf-ckpt-compile", "sac-compile", "fxopt-eager@1.0", "aot-eager")
# Not run unless asked for (``--variants``): references for the eager compiler's overhead and for
# what fxopt's Inductor settings cost.
OPTIONAL_VARIANTS = ("aot-eager", "fxopt-inductor-free@1.0", "fxopt-inductor@hf-fused")
# Inductor's own fusion choices, memory reorder and buffer reuse (``fxopt-inductor-free@1.0``), in
# place of the ones fxopt compiles its plan with to keep its schedule (`fxopt.capture.inductor`).
FREE_FUSION = {"inductor_choices_class": None, "reorder_for_peak_memory": True, "allow_buffer_reuse": True}


def titan_selective_context():
    """torchtitan's ``SelectiveAC`` policy (op mode, torchtitan 0.3.0's
    ``distributed/activation_checkpoint.py``), as a ``context_fn`` for `torch.utils.checkpoint`:
    SAVE the outputs of the partitioner's compute-intensive ops (matrix products, attention,
    convolutions), of ``linear`` and of ``max``, except every second matrix product (counted apart
    in the forward and in the recomputation); RECOMPUTE the rest. torchtitan's SDPA list names the
    CUDA kernels; the host's (``_scaled_dot_product_flash_attention_for_cpu``) is saved too, as
    torchtitan would save its GPU counterpart. One policy per checkpointed call."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    save |= {aten.linear.default, aten.max.default, aten._scaled_dot_product_attention_math.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default}
    matmuls = (aten.mm.default, aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            counts[mode] += 1
        if func in save and not (func in matmuls and counts[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_compiles():
    """Around ``sac-compile``'s compile: Dynamo traces each checkpointed layer into the graph even
    though its forward mutates state outside it (transformers' ``kernels`` hub layers set a
    context variable), which it would otherwise split the step at, running every checkpointed
    layer eagerly, its selective policy too (torchtitan's own models compile whole without it).
    The side effect is not replayed in the recomputation; the gradients are still compared with
    eager's."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def fastest_within(rows: list[dict[str, Any]], budget: int | None) -> dict[str, Any] | None:
    """Among ``rows`` (one model's, timed) whose measured peak is within ``budget`` bytes, eager's
    aside: {"budget_bytes", "rows": their variants, fastest first (by the median of each round's
    ratio to ``compile``'s, else to eager's), "fastest", "fxopt_fastest": whether fxopt's row is}.
    None without a budget or without a row within it."""
    if budget is None:
        return None
    rows = [r for r in rows if "error" not in r]
    key = "vs_compile" if all(r.get("vs_compile") is not None for r in rows) else "vs_eager"
    within = sorted((r for r in rows if r["variant"] != "eager" and r.get(key) is not None
                     and r["measured_peak_bytes"] <= budget), key=lambda r: r[key])
    if not within:
        return None
    return {"budget_bytes": budget, "by": key, "rows": [(r["variant"], r[key], r["measured_peak_bytes"]) for r in within],
            "fastest": within[0]["variant"], "fxopt_fastest": within[0]["variant"].startswith("fxopt-")}


class Variant:
    """One way of running the model: ``build()`` -> the callable a step calls, on its own copy
    ``model``; ``budget``: the bytes it was asked to stay within (fxopt's), None elsewhere;
    ``compile_ctx``: around its first step (where torch's partitioner reads its setting)."""

    def __init__(self, name: str, model: torch.nn.Module, build: Callable[[], Callable],
                 compile_ctx: Callable[[], Any] = contextlib.nullcontext):
        self.name, self.model, self.build, self.compile_ctx = name, model, build, compile_ctx
        self.fn: Callable | None = None
        self.row: dict[str, Any] = {"variant": name, "notes": []}
        self.times: list[float] = []


def recomputed_by_class(plan) -> dict[str, int]:
    """How many recomputations a plan makes, by op class (`fxopt.solvers.Node.op_class`; "other"
    for the ops of none): what a pricing changes."""
    classes = {n.name: n.op_class or "other" for n in plan.graph.nodes}
    out: collections.Counter[str] = collections.Counter()
    for name, times in plan.recomputed.items():
        out[classes.get(name, "other")] += times
    return dict(sorted(out.items()))


class _Notes(logging.Handler):
    """fxopt's log lines that say which step a compile chose (Inductor's own step, or its plan)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Inductor's own step" in message and ("running" in message or "instead" in message):
            self.lines.append(message.removeprefix("fxopt: "))


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls (generator resumptions too) while ``fn()`` runs: the Python a step
    runs beside its kernels, counted (the same on a busy machine and a quiet one)."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return calls


class ModelRun:
    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        torch.manual_seed(0)
        self.model, inputs = MODELS[name](args.size)
        self.model.to(args.device)
        self.inputs = tuple(x.to(args.device) for x in inputs)
        self.entry = MODELS[name]
        self.info: dict[str, Any] = {"model": name, "input_shapes": [list(x.shape) for x in self.inputs],
                                     "params_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
                                     "load_start": load_average()}
        self.variants: list[Variant] = []

    # ---- references -----------------------------------------------------------------------------

    def measured_peak(self, fn: Callable, model: torch.nn.Module) -> int:
        return self.measured(fn, model).peak_bytes

    def measured(self, fn: Callable, model: torch.nn.Module) -> PeakMemory:
        model.zero_grad(set_to_none=True)
        return fxopt.measure_peak(lambda *inp: train_step(fn, inp), *self.inputs, resident=[model])

    def references(self) -> None:
        model = self.model
        model.zero_grad(set_to_none=True)
        train_step(model, self.inputs)
        model.zero_grad(set_to_none=True)
        self.ref_loss = train_step(model, self.inputs)
        self.ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        self.info["eager_peak_bytes"] = self.measured_peak(model, model)
        self.hf_peak = None
        if self.entry.checkpointing is not None and getattr(getattr(model, "hf", None), "supports_gradient_checkpointing",
                                                             False):
            checkpointed = copy.deepcopy(model)
            self.entry.checkpointing(checkpointed, True)
            train_step(checkpointed, self.inputs)
            self.hf_peak = self.info["hf_ckpt_eager_peak_bytes"] = self.measured_peak(checkpointed, checkpointed)
        model.zero_grad(set_to_none=True)

    # ---- variants -------------------------------------------------------------------------------

    def make_variants(self) -> None:
        wanted = self.args.variants
        hf = self.hf_peak

        def copy_of(checkpointing: bool = False) -> torch.nn.Module:
            model = copy.deepcopy(self.model)
            if checkpointing:
                self.entry.checkpointing(model, True)
            return model

        def compiled(model: torch.nn.Module) -> Callable[[], Callable]:
            return lambda: torch.compile(own_frame(model))

        def optimized(model: torch.nn.Module, budget: float | int | Callable[[], int], compiler: str,
                      **options: Any) -> Callable[[], Callable]:
            return lambda: fxopt.optimize(model, budget() if callable(budget) else budget, compiler=compiler,
                                          time_limit=self.args.time_limit, **options)

        def half_of_inductor() -> int:
            """Plain Inductor's measured peak less half its increase (its activations), in bytes."""
            compile_row = next((v.row for v in self.variants if v.name == "compile"), {})
            if "measured_start_bytes" not in compile_row:
                raise RuntimeError("fxopt-inductor@half needs the compile variant measured first (--variants compile,...)")
            return compile_row["measured_start_bytes"] + compile_row["measured_increase_bytes"] // 2

        for base in BASE_VARIANTS:
            if base not in wanted:
                continue
            if base == "eager":
                self.variants.append(Variant("eager", self.model, lambda: self.model))
            elif base == "compile":
                m = copy_of()
                self.variants.append(Variant("compile", m, compiled(m)))
            elif base in ("fxopt-inductor@1.0", "fxopt-eager@1.0"):
                m = copy_of()
                compiler = "inductor" if "inductor" in base else "eager"
                self.variants.append(Variant(base, m, optimized(m, 1.0, compiler)))
            elif base == "fxopt-inductor-free@1.0":
                m = copy_of()
                self.variants.append(Variant(base, m, optimized(m, 1.0, "inductor", inductor_config=FREE_FUSION)))
            elif base in ("fxopt-inductor@hf", "fxopt-inductor@hf-fused"):
                if hf is None:
                    continue
                m = copy_of()
                pricing = {"cost_model": CostModel(fused_pointwise=True)} if base.endswith("fused") else {}
                v = Variant(base, m, optimized(m, hf, "inductor", **pricing))
                v.row["budget_bytes"] = hf
                self.variants.append(v)
            elif base == "fxopt-inductor@half":
                m = copy_of()
                self.variants.append(Variant(base, m, optimized(m, half_of_inductor, "inductor")))
            elif base == "compile-amb":
                for amb in self.args.amb:
                    m = copy_of()
                    self.variants.append(Variant(f"compile-amb@{amb:g}", m, compiled(m),
                                                 lambda amb=amb: torch._functorch.config.patch(
                                                     activation_memory_budget=amb)))
            elif base == "aot-eager":
                m = copy_of()
                self.variants.append(Variant("aot-eager", m, lambda m=m: torch.compile(own_frame(m), backend="aot_eager")))
            elif base == "hf-ckpt-compile" and hf is not None:
                m = copy_of(checkpointing=True)
                self.variants.append(Variant("hf-ckpt-compile", m, compiled(m)))
            elif base == "sac-compile" and hf is not None:
                m = copy_of()
                hf_zoo.hf_checkpointing(m, True, {"use_reentrant": False, "context_fn": titan_selective_context})
                self.variants.append(Variant("sac-compile", m, compiled(m), checkpoint_compiles))

    def warm_up(self, v: Variant) -> None:
        """Build, first step (compiles and plans), then its peak and its gradients against eager's."""
        log(f"--- {self.name}: {v.name}")
        notes = _Notes()
        fxlog = logging.getLogger("fxopt")
        level = fxlog.level
        fxlog.addHandler(notes)
        fxlog.setLevel(logging.INFO)
        t0 = time.perf_counter()
        try:
            v.fn = v.build()
            v.model.zero_grad(set_to_none=True)
            with v.compile_ctx():
                loss = train_step(v.fn, self.inputs)
            synchronize(loss.device)
        finally:
            v.row["compile_s"] = round(time.perf_counter() - t0, 1)
            fxlog.removeHandler(notes)
            fxlog.setLevel(level)
        v.row["notes"] += notes.lines
        plan = getattr(v.fn, "plan", None)
        if plan is not None:
            v.row.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.peak_bytes,
                         plan_recomputations=sum(plan.recomputed.values()), plan_extra_flops=plan.recompute_flops,
                         plan_recompute_cost=plan.recompute_cost, plan_recomputed_by_class=recomputed_by_class(plan))
        v.row["loss_equal"] = bool(torch.allclose(loss, self.ref_loss, **TOLERANCE))
        v.row["grads_equal"] = all(
            p.grad is not None and torch.allclose(p.grad, self.ref_grads[n], **TOLERANCE)
            for n, p in v.model.named_parameters() if n in self.ref_grads)
        measured = self.measured(v.fn, v.model)
        v.row["measured_peak_bytes"] = peak = measured.peak_bytes
        v.row["measured_start_bytes"], v.row["measured_increase_bytes"] = measured.start_bytes, measured.increase_bytes
        v.model.zero_grad(set_to_none=True)
        v.row["python_calls"] = python_calls(lambda: train_step(v.fn, self.inputs))
        if v.row.get("budget_bytes") is not None:
            v.row["within_budget"] = peak <= v.row["budget_bytes"]
        log(f"    compiled in {v.row['compile_s']} s; measured {mib(peak)} MiB"
            + (f" (budget {mib(v.row['budget_bytes'])})" if v.row.get("budget_bytes") else "")
            + f"; grads {'equal' if v.row['grads_equal'] else 'DIFFER'}" + "".join(f"; {n}" for n in v.row["notes"]))

    def time_rounds(self, ready: list[Variant]) -> None:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for r in range(self.args.steps):
            k = r % len(ready)
            for v in ready[k:] + ready[:k]:
                v.model.zero_grad(set_to_none=True)
                synchronize(self.inputs[0].device)
                t0 = time.perf_counter()
                train_step(v.fn, self.inputs)
                synchronize(self.inputs[0].device)
                v.times.append(time.perf_counter() - t0)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
            self.info["recompiled_while_timed"] = True

    def execute(self) -> list[dict[str, Any]]:
        self.references()
        self.make_variants()
        ready = []
        for v in self.variants:
            try:
                self.warm_up(v)
                ready.append(v)
            except Exception as err:  # noqa: BLE001 - one variant that fails is a row with its error
                v.row["error"] = error_line(unwrap_compile_error(err) or err)
                log(traceback.format_exc(limit=6))
        log(f"--- {self.name}: {self.args.steps} timed rounds of {len(ready)} variants")
        self.time_rounds(ready)
        eager = next((v for v in ready if v.name == "eager"), None)
        plain = next((v for v in ready if v.name == "compile"), None)
        for v in ready:
            v.row["step_ms"] = 1e3 * statistics.median(v.times)
            v.row["min_step_ms"] = 1e3 * min(v.times)
            v.row["step_times_ms"] = [round(1e3 * t, 3) for t in v.times]
            for ref, key in ((eager, "vs_eager"), (plain, "vs_compile")):
                if ref is not None:  # (each round's ratio, then their median: the load drifts between rounds)
                    v.row[key] = statistics.median(a / b for a, b in zip(v.times, ref.times))
                    v.row[key + "_of_medians"] = statistics.median(v.times) / statistics.median(ref.times)
        self.info["load_end"] = load_average()
        return [dict(model=self.name, **v.row) for v in self.variants]


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.perf_counter()
        command = "python -m benchmarks.step_time " + shlex.join(args.argv)
        self.result: dict[str, Any] = {
            "meta": run_meta(command.strip(), device=args.device, size=args.size, steps=args.steps, seq=args.seq, batch=args.batch,
                             image_batch=args.image_batch, amb=list(args.amb)),
            "models": [], "rows": []}

    def execute(self) -> None:
        saved = saved_settings()
        caches, cache_dir = torch.compiler.config.force_disable_caches, os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        torch.set_num_threads(1)
        os.environ["FXOPT_CACHE"] = "0"
        # Every compile made in this run: no cached graph, and the compiled kernels in a folder of its own.
        torch.compiler.config.force_disable_caches = True
        kernels = tempfile.TemporaryDirectory(prefix="step_time_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = kernels.name
        try:
            for name in self.args.models:
                run = ModelRun(name, self.args)
                try:
                    self.result["rows"] += run.execute()
                except Exception as err:  # noqa: BLE001 - a model that does not run is a row, and the run goes on
                    log(traceback.format_exc())
                    self.result["rows"].append({"model": name, "variant": "–", "error": error_line(err)})
                self.result["models"].append(run.info)
                torch._dynamo.reset()
                write_results(self.args.out, self.result, markdown(self.result))
        finally:
            torch.compiler.config.force_disable_caches = caches
            if cache_dir is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
            kernels.cleanup()
            restore_settings(saved)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = report_head("Step time: fxopt against torch.compile (issue 28)", meta,
                        f"median of {meta['steps']} interleaved rounds (ratios: median of each round's), text {meta['batch']}×{meta['seq']}, "
                        f"images {meta['image_batch'] or 'bench'} per step")
    infos = {m["model"]: m for m in result["models"]}
    for name in dict.fromkeys(r["model"] for r in result["rows"]):
        info = infos.get(name, {})
        lines += [f"## {name}", "",
                  f"Eager measured {mib(info.get('eager_peak_bytes'))} MiB; HF checkpointing "
                  f"{mib(info.get('hf_ckpt_eager_peak_bytes'))} MiB (eager). Load {info.get('load_start', '?')} at the "
                  f"start, {info.get('load_end', '?')} at the end"
                  + ("; **Dynamo recompiled during the timed rounds**" if info.get("recompiled_while_timed") else "")
                  + ".", "",
                  "| variant | step ms (median) | fastest | × eager | × torch.compile | Python calls | measured peak MiB "
                  "| budget MiB | within | compile s | loss, grads equal | notes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
        for r in (r for r in result["rows"] if r["model"] == name):
            if "error" in r:
                lines.append(f"| {r['variant']} | {r['error']} ||||||||||| ")
                continue
            within = {True: "yes", False: "**NO**"}.get(r.get("within_budget"), "–")
            lines.append(
                f"| {r['variant']} | {r['step_ms']:.1f} | {r['min_step_ms']:.1f} | {_ratio(r.get('vs_eager'))} | "
                f"{_ratio(r.get('vs_compile'))} | {r.get('python_calls', '–')} | "
                f"{mib(r['measured_peak_bytes'])} | {mib(r.get('budget_bytes'))} | {within} | {r['compile_s']:.0f} | "
                f"{'yes' if r['loss_equal'] and r['grads_equal'] else '**no**'} | {'; '.join(r['notes'])} |")
        lines.append("")
        lines += [f"- {line}" for line in plan_lines([r for r in result["rows"] if r["model"] == name])]
        lines += [f"- {line}" for line in at_each_memory(info, [r for r in result["rows"] if r["model"] == name])]
        lines.append("")
    return "\n".join(lines)


def plan_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per fxopt row: what its plan recomputes (by op class), its FLOPs and estimated
    seconds (in its own cost model's pricing)."""
    return [f"{r['variant']}'s plan: {r['plan_recomputations']} recomputations ("
            + ", ".join(f"{k} {n}" for k, n in r.get("plan_recomputed_by_class", {}).items())
            + f"), +{r['plan_extra_flops'] / 1e9:.2f} GFLOP, estimated +{1e3 * r.get('plan_recompute_cost', 0.0):.2f} ms"
            for r in rows if "error" not in r and r.get("plan_recomputations") is not None]


def memories(info: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The memories issue 28 compares the rows at: HF checkpointing's measured peak, and plain
    Inductor's peak less half its increase (its activations), where the run has them."""
    out = []
    if info.get("hf_ckpt_eager_peak_bytes"):
        out.append(("HF checkpointing's peak", info["hf_ckpt_eager_peak_bytes"]))
    plain = next((r for r in rows if r["variant"] == "compile" and "measured_start_bytes" in r), None)
    if plain is not None:
        out.append(("half of plain Inductor's activations",
                    plain["measured_start_bytes"] + plain["measured_increase_bytes"] // 2))
    return out


def at_each_memory(info: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """One line per memory of `memories`: the rows measured within it, fastest first, and which."""
    lines = []
    for label, budget in memories(info, rows):
        found = fastest_within(rows, budget)
        if found is None:
            lines.append(f"At {label} ({mib(budget)} MiB): no row measured within it.")
            continue
        against = "× torch.compile" if found["by"] == "vs_compile" else "× eager"
        listed = ", ".join(f"{v} {ratio:.2f} ({mib(peak)} MiB)" for v, ratio, peak in found["rows"])
        lines.append(f"At {label} ({mib(budget)} MiB), the rows measured within it, fastest first ({against}): "
                     f"{listed}; fastest: **{found['fastest']}**"
                     + ("" if found["fxopt_fastest"] else " (not fxopt's)") + ".")
    return lines


def main(argv: list[str] | None = None) -> Run:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names")
    parser.add_argument("--variants", default=",".join(v for v in BASE_VARIANTS if v not in OPTIONAL_VARIANTS),
                        help=f"comma-separated, of {', '.join(BASE_VARIANTS)}")
    parser.add_argument("--amb", default=",".join(f"{a:g}" for a in DEFAULT_AMB),
                        help="activation_memory_budget values of the compile-amb rows")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds (the median of them is reported)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (text models)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (text models)")
    parser.add_argument("--image-batch", type=int, default=None, help="images per step (default: hf_zoo's bench)")
    parser.add_argument("--device", default="cpu", help="where the models run (cuda: benchmarks/gpu_step_time.sh)")
    parser.add_argument("--size", default="bench", choices=hf_zoo.SIZES, help="the zoo's size (test: a quick check)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="fxopt's planning safety stop, seconds")
    parser.add_argument("--out", default="benchmarks/results/step_time", help="results path, without suffix")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.models = choose(args.models, tuple(MODELS), "model")
    args.variants = choose(args.variants, BASE_VARIANTS, "variant")
    args.amb = tuple(float(a) for a in args.amb.split(",") if a.strip())
    hf_zoo.TEXT[args.size] = dict(hf_zoo.TEXT[args.size], seq=args.seq, batch=args.batch)
    if args.image_batch is not None:
        hf_zoo.IMAGE[args.size] = dict(hf_zoo.IMAGE[args.size], batch=args.image_batch)
    run = Run(args)
    run.execute()
    log(f"done in {time.perf_counter() - run.t0:.0f} s; wrote {args.out}.md")
    return run


if __name__ == "__main__":
    main()
