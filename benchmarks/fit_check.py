"""A device profile's prediction, made on fake tensors without the device, against the peak
measured on the device (issue 27: "compares a fake-planned CUDA prediction with the measured peak").

    python -m benchmarks.fit_check [--device cuda] [--profile auto] [--models llama,gpt2]
        [--budgets 1.0,0.5,min] [--size gpu] [--out benchmarks/results/fit_check_gpu]
    python -m benchmarks.fit_check --dry-run     # this host's CPU, the "cpu" profile, tiny models

Per model (a transformers ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` built from configs, in
``--dtype``, with labels), first on fake tensors, as `fxopt fit` plans on a machine without the
device:

- the model is built under ``torch.device("meta")`` and `fxopt.plan` plans its step for the
  profile (``device=``) at each budget (a share of the predicted eager peak, or ``"min"``): the
  predicted eager peak, the plan's budget in bytes and its predicted peak;

then on the device, with the same configuration and inputs:

- eager: one step (from no gradients) measured by `fxopt.measure_peak` (on CUDA
  ``torch.cuda.max_memory_allocated``: everything allocated, parameters and cuBLAS's workspace
  included), against the predicted eager peak (for a CUDA profile an upper bound: the scratch
  is a stated conservative formula, see docs/will-it-fit.md);
- fxopt: `fxopt.optimize` of a copy at each fake plan's budget **in bytes** (the same number the
  profile's answer gave), its second step measured: within that budget or not, and against the
  fake plan's predicted peak; the gradients against eager's (``max_abs``: bfloat16 kernels on a
  GPU need not be bit-equal between two runs where atomics sum). Where the budget does not plan
  on the device (its kernels are not the host's), the error's minimum is the row's.

``--profile auto`` names the shipped profile of the GPU that torch reports (H200, H100-80GB,
A100-40GB). ``--dry-run`` runs the same on this host's CPU with the ``cpu`` profile and small
models, in about a minute: every number there is the host's, so its prediction must equal the
measurement; it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import compare_grads, log, mib, report_head, restore_settings, run_rows, saved_settings
from fxopt.errors import InfeasibleBudgetError

# (layers, hidden, heads, ffn, vocabulary, sequence, batch) per --size
SIZES = {
    "gpu": {"llama": (4, 2048, 16, 5632, 32000, 2048, 4), "gpt2": (4, 1024, 16, 4096, 50257, 1024, 8)},
    "tiny": {"llama": (2, 128, 4, 512, 1024, 128, 4), "gpt2": (2, 128, 4, 512, 1024, 128, 4)},
}
GPU_PROFILES = (("H200", "H200"), ("H100", "H100-80GB"), ("A100", "A100-40GB"))


def build(name: str, size: str, dtype: torch.dtype, device: str | torch.device):
    """The model ``name`` at ``size`` on ``device`` (``"meta"``: no memory), and its inputs on the
    host (token ids and labels, the same for every build)."""
    import transformers

    layers, hidden, heads, ffn, vocab, seq, batch = SIZES[size][name]
    if name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 4), intermediate_size=ffn,
                                          vocab_size=vocab, max_position_embeddings=seq, use_cache=False)
        cls = transformers.LlamaForCausalLM
    elif name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=ffn, n_positions=seq,
                                         vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(f"unknown model {name!r}: llama or gpt2")
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype)
    model.train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def profile_for(device: torch.device, asked: str) -> str:
    if asked != "auto":
        return asked
    if device.type == "cpu":
        return "cpu"
    gpu = torch.cuda.get_device_name(device)
    for marker, profile in GPU_PROFILES:
        if marker in gpu:
            return profile
    raise SystemExit(f"no shipped profile for {gpu!r}: give --profile (a name of fxopt.devices.names(), or a JSON)")


def step(model, inputs) -> torch.Tensor:
    out = model(**inputs)  # (held through the backward, as a training loop holds it: the logits too)
    out.loss.backward()
    return out.loss.detach()


def on(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


def measured(model, inputs: dict, device: torch.device) -> int:
    model.zero_grad(set_to_none=True)
    return fxopt.measure_peak(step, model, inputs, resident=[model], device=device).peak_bytes


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_of(name: str, args, device: torch.device, profile: str) -> dict:
    dtype = getattr(torch, args.dtype)
    meta_model, inputs = build(name, args.size, dtype, "meta")
    fake = []
    for budget in args.budgets:
        try:
            plan = fxopt.plan(meta_model, budget if budget == "min" else float(budget), inputs, device=profile,
                              time_limit=args.time_limit)
            fake.append({"budget": budget, "budget_bytes": plan.budget_bytes, "predicted": plan.peak_bytes,
                         "eager_predicted": plan.eager_peak_bytes, "solver": plan.solver,
                         "recompute_gflop": plan.recompute_flops / 1e9})
        except InfeasibleBudgetError as err:
            fake.append({"budget": budget, "infeasible": True, "min_budget": err.min_budget})
        log(f"  fake {budget}: {fake[-1]}")
    del meta_model
    eager_predicted = next((f["eager_predicted"] for f in fake if "eager_predicted" in f), None)

    model, _ = build(name, args.size, dtype, device)
    inputs_dev = on(inputs, device)
    step(model, inputs_dev)  # (a first step: the allocator's and libraries' one-time state)
    eager = measured(model, inputs_dev, device)
    ref = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    row = {"model": name, "profile": profile, "device": str(device), "dtype": args.dtype,
           "eager_measured": eager, "eager_predicted": eager_predicted,
           "eager_ratio": eager_predicted / eager if eager_predicted else None, "budgets": []}
    log(f"  eager measured {mib(eager)} MiB, predicted {mib(eager_predicted)} MiB")
    for f in fake:
        out = dict(f)
        if f.get("infeasible"):
            row["budgets"].append(out)
            continue
        copy_ = copy.deepcopy(model)
        copy_.zero_grad(set_to_none=True)
        try:
            optimized = fxopt.optimize(copy_, f["budget_bytes"], time_limit=args.time_limit)
            step(optimized, inputs_dev)  # (plans)
            out["measured"] = measured(optimized, inputs_dev, device)
            out["within"] = out["measured"] <= f["budget_bytes"]
            out["device_predicted"] = optimized.plan.peak_bytes
            out.update(compare_grads(copy_, ref))
        except InfeasibleBudgetError as err:
            out["device_error"] = f"infeasible on the device: its minimum {err.min_budget}"
            out["device_min"] = err.min_budget
        except Exception as err:  # noqa: BLE001 - a budget that fails is a row, and the run goes on
            out["device_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        log(f"  fxopt {f['budget']}: {out}")
        row["budgets"].append(out)
        del copy_
        release(device)
    del model
    release(device)
    return row


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = report_head("A profile's prediction on fake tensors against the device's measured peak", meta,
                        "Predicted: `fxopt.plan` of the model built on meta for the profile (no device). Measured: "
                        "the same model on the device, `fxopt.measure_peak` of a step from no gradients. fxopt's "
                        "rows run `fxopt.optimize` at the fake plan's budget in bytes.")
    lines += ["| model | profile | what | budget MiB | predicted MiB | measured MiB | measured / predicted | within | "
              "grads max abs diff | note |", "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | | | | | | | | | {row['error']} |")
            continue
        pred, meas = row["eager_predicted"], row["eager_measured"]
        ratio = f"{meas / pred:.3f}" if pred else ""
        lines.append(f"| {row['model']} | {row['profile']} | eager | – | {mib(pred)} | {mib(meas)} | {ratio} | "
                     f"{'yes' if pred and meas <= pred else 'NO'} | – | predicted eager: an upper bound? |")
        for b in row["budgets"]:
            if b.get("infeasible"):
                lines.append(f"| | | fxopt@{b['budget']} | | | | | | | infeasible on fake tensors: minimum "
                             f"{mib(b['min_budget'])} MiB |")
                continue
            m = b.get("measured")
            note = b.get("device_error", f"{b['solver']}, +{b['recompute_gflop']:.1f} GFLOP; the device's own plan "
                                         f"predicted {mib(b.get('device_predicted'))} MiB")
            if m is None:
                lines.append(f"| | | fxopt@{b['budget']} | {mib(b['budget_bytes'])} | {mib(b['predicted'])} | | | | | "
                             f"{note} |")
                continue
            lines.append(f"| | | fxopt@{b['budget']} | {mib(b['budget_bytes'])} | {mib(b['predicted'])} | {mib(m)} | "
                         f"{m / b['predicted']:.3f} | {'yes' if b['within'] else '**NO**'} | "
                         f"{b['grad_max_abs_diff']:.3g} | {note} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--profile", default="auto")
    p.add_argument("--models", default="llama,gpt2")
    p.add_argument("--budgets", default="1.0,0.5,min")
    p.add_argument("--size", default=None, choices=sorted(SIZES), help="default: gpu, tiny with --dry-run")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--dry-run", action="store_true", help="this host's CPU, the cpu profile, tiny models")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--dry-run checks the script on the CPU)")
    args.size = args.size or ("tiny" if args.dry_run or device.type == "cpu" else "gpu")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.budgets = args.budgets.split(",")
    profile = profile_for(device, args.profile)
    out = args.out or f"benchmarks/results/fit_check_{'gpu' if device.type == 'cuda' else 'dry_run_cpu'}"
    command = "python -m benchmarks.fit_check " + " ".join(sys.argv[1:] if argv is None else argv)
    saved = saved_settings()
    try:
        torch.set_num_threads(1)
        return run_rows(command, args.models.split(","), lambda name: row_of(name, args, device, profile), Path(out),
                        markdown)
    finally:
        restore_settings(saved)


if __name__ == "__main__":
    main()
