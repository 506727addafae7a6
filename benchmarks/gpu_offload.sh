#!/usr/bin/env bash
# OFFLOAD on one CUDA GPU in under 8 minutes: a 4-layer GPT-2 (width 768, seq 512, batch 8) at 30%
# and 50% of its activations; fxopt's plan with OFFLOAD against the best plan without it, the
# same schedule without the copies (the compute alone, for the measured exposed time),
# torchtune-style offload-everything hooks and torch.autograd.graph.save_on_cpu. See
# benchmarks/offload.py. Prepared without a GPU: only its dry run has been run.
#
#   benchmarks/gpu_offload.sh [OUT_DIR]          # default: $OUT, else benchmarks/results
#   benchmarks/gpu_offload.sh --dry-run [OUT_DIR]  # CPU, a tiny GPT-2: checks the code paths (~1 min)
#
# Run from anywhere; it works from the repository root. Peaks come from
# torch.cuda.max_memory_allocated (through fxopt.measure_peak). Each row is written as soon as it
# is measured; no row starts after 6.5 minutes and `timeout` stops the run at 7.5, so partial
# results are always left in OUT_DIR (offload_cuda.md / .json).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
DRY=()
if [ "${1:-}" = "--dry-run" ]; then
  DRY=(--dry-run)
  shift
fi
OUT_DIR="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"

{
  gpu_env "$PY"
} > "$OUT_DIR/offload_env.txt" 2>&1

timeout -k 15 450 "$PY" -m benchmarks.offload "${DRY[@]}" --deadline 390 --out "$OUT_DIR" \
  > "$OUT_DIR/offload_log.txt" 2>&1
status=$?
echo "exit status $status (124: stopped by timeout; results so far are in $OUT_DIR)" | tee -a "$OUT_DIR/offload_log.txt"
ls -l "$OUT_DIR"/offload_*
exit $status
