"""Communication beside compute in a sharded step: a profiler trace on each of 2 gloo ranks.

    python -m benchmarks.overlap --out benchmarks/results/overlap_mlp_w2
    python -m benchmarks.overlap --mixed-precision --out benchmarks/results/overlap_mlp_bf16_w2

A four-block MLP (``tests/overlap_steps.py``: 256 wide, 1,024 rows over the ranks) sharded with
`fxopt.distributed.fully_shard`, planned by ``fxopt.optimize`` at 85% of eager's predicted peak
(some recomputation, some re-gathers), run under ``torch.profiler`` for three steps after three
warm ones, on every rank. Rows, per rank:

  - ``ahead``: the step as fxopt rewrites it, each forward all-gather issued ahead of its first use
    where the simulator issues it (`fxopt.passes.waits.issue_gathers_ahead`), the backward's
    re-gathers likewise (`fxopt.solvers.prefetch`);
  - ``at once``: the same plan with the forward's all-gathers left where captured (the move taken
    out), as before issue 26's forward prefetch;
  - ``reduce-scatters waited at once``: each gradient's reduce-scatter waited for where it is
    issued (`fxopt.solvers.prefetch.prefetched`'s move of the waits taken out), as before
    ``rs29``: in ``ahead`` each is waited for as late as the plan's memory allows;
  - ``ahead, priced at 0.1 GB/s``: planned with communication priced at 0.1 GB/s, not gloo's
    default 1 GB/s, nearer what the trace measures on this loaded machine: the gathers are issued
    further ahead.

For each, per step and phase: the gloo collectives (``gloo:all_gather``: the gathers and
re-gathers; ``gloo:all_reduce``: the reduce-scatters, `fxopt.ops.collectives.reduce_scatter`) on
gloo's worker thread, their ms in flight, and the ms of those during which the step's own thread
ran an aten op (compute, not a wait); the step's wall seconds (noisy on a shared machine: see the
load) and measured peak against the plan.

``--mixed-precision``: the same MLP under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``
(gathered in bf16, the gradients reduced in bf16 and each reduced shard cast to the float32
shard's dtype after its wait: the cast moves with the wait, `fxopt.solvers.prefetch._followers`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from benchmarks.harness import log, report_head, run_meta, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def markdown(result: dict) -> str:
    lines = report_head("Communication beside compute in a sharded step (2 gloo ranks"
                        + (", MixedPrecisionPolicy(param_dtype=bf16))" if result.get("mixed_precision") else ")"),
                        result["meta"])
    lines += ["Per step (mean of 3 profiled steps), per rank. In flight: ms of gloo collectives on gloo's worker "
              "thread; beside compute: ms of those while the step's own thread ran an aten op. Peak: measured / "
              "predicted / budget, bytes.", "",
              "| rank | row | phase collective | count | in flight ms | beside compute ms | step s | peak | re-gathered B |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rank, rows in enumerate(result["ranks"]):
        for name, row in rows.items():
            peak = f"{row['measured']} / {row['predicted']} / {row['budget']}"
            for k, v in row["overlap"].items():
                lines.append(f"| {rank} | {name} | {k} | {v['count']:g} | {v['in_flight_ms']:.2f} | "
                             f"{v['beside_compute_ms']:.2f} | {row['step_s']:.3f} | {peak} | {row['regathered_bytes']} |")
    if result.get("trace"):
        lines += ["", f"Rank 0's trace of the ``ahead`` steps (Chrome's format): `{result['trace']}`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/overlap_mlp_w2")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mixed-precision", action="store_true",
                        help="the MLP under MixedPrecisionPolicy(param_dtype=bf16)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    meta = run_meta(" ".join(["python -m benchmarks.overlap", *(shlex.quote(a) for a in argv)]))
    trace = f"{args.out}_trace_rank0.json.gz"
    Path(trace).parent.mkdir(parents=True, exist_ok=True)
    os.environ["OVERLAP_TRACE"] = str(Path(trace).resolve())
    import overlap_steps

    ranks = overlap_steps.run("profiled-mp" if args.mixed_precision else "profiled", args.world)
    meta["load_after"] = os.getloadavg()
    result = {"meta": meta, "ranks": ranks, "trace": trace, "mixed_precision": args.mixed_precision}
    log(f"wrote {write_results(args.out, result, markdown(result))}")


if __name__ == "__main__":
    main()
