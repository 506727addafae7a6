"""The eager compiler's direct op calls, timed against FX's own (issue 28), in one process.

    python -m benchmarks.op_calls [--models hf-llama,hf-vit] [--rounds 21]

Per model (`fxopt.models.MODELS` at "bench" size, one torch thread), three variants, each on its
own deep copy of the model: ``eager``; ``fx-calls``, ``fxopt.optimize(model, 1.0)`` whose FX code
calls each op as ``torch.ops.<ns>.<op>.<overload>(...)`` (FX's ``_BoxedCodeGen`` in place of
`fxopt.capture.opcalls.DirectOpCodeGen` while it compiles); ``direct``, the same with each op's
builtin called (fxopt's default). Each is checked bit for bit against eager (loss and every
gradient, ``torch.equal``) and its Python calls per step counted; then ``--rounds`` rounds, round
robin, the order rotated each round, gradients cleared before each step. Printed: each variant's
median step and median per-round ratio to eager, and ``direct``'s median per-round ratio to
``fx-calls``. CPU timings on a shared machine are noisy: read them with the load printed.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.fx as fx

import fxopt
import fxopt.capture.dynamo as dynamo
from benchmarks import hf_zoo  # noqa: F401 (registers the hf-* models)
from benchmarks.harness import train_step
from benchmarks.step_time import python_calls
from fxopt.models import MODELS

VARIANTS = ("eager", "fx-calls", "direct")


def run_model(name: str, rounds: int) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]("bench")
    direct = dynamo.DirectOpCodeGen
    rows, reference = {}, None
    for variant in VARIANTS:
        m = copy.deepcopy(model)
        fn = m if variant == "eager" else fxopt.optimize(m, 1.0)
        if variant == "fx-calls":  # (the first steps compile: a model may recompile at its second)
            dynamo.DirectOpCodeGen = fx.graph._BoxedCodeGen
        try:
            for _ in range(2):
                m.zero_grad(set_to_none=True)
                loss = train_step(fn, inputs)
        finally:
            dynamo.DirectOpCodeGen = direct
        grads = [p.grad.clone() for p in m.parameters()]
        reference = reference or (loss, grads)
        equal = torch.equal(loss, reference[0]) and all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
        m.zero_grad(set_to_none=True)
        calls = python_calls(lambda: train_step(fn, inputs))
        rows[variant] = {"model": m, "fn": fn, "times": [], "calls": calls, "equal": equal}
    for r in range(rounds):
        for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            row = rows[variant]
            row["model"].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            train_step(row["fn"], inputs)
            row["times"].append(time.perf_counter() - t0)
    eager = rows["eager"]["times"]
    for variant, row in rows.items():
        ratio = statistics.median(t / e for t, e in zip(row["times"], eager))
        print(f"{name} {variant:8s} median {statistics.median(row['times']) * 1e3:7.1f} ms  x eager {ratio:.3f}  "
              f"Python calls {row['calls']}  loss and grads bit-equal to eager: {row['equal']}")
    fx_calls, direct_times = rows["fx-calls"]["times"], rows["direct"]["times"]
    print(f"{name} direct / fx-calls: median per-round ratio "
          f"{statistics.median(a / b for a, b in zip(direct_times, fx_calls)):.3f}, median saving "
          f"{statistics.median(b - a for a, b in zip(direct_times, fx_calls)) * 1e3:.2f} ms a step")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="hf-llama,hf-vit")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start")
    for name in args.models.split(","):
        run_model(name, args.rounds)
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
