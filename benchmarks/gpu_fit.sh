#!/usr/bin/env bash
# benchmarks.fit_check on one CUDA GPU in under 8 minutes (issue 27: a profile's prediction made on
# fake tensors, without the device, against the peak measured on it; prepared for the GPU machine
# the tool library lends to some tasks; not yet run on a GPU).
#
#   benchmarks/gpu_fit.sh [OUT_DIR]        # default: $OUT, else benchmarks/results/fit_check_gpu
#
# Run from the repository root. The profile is the shipped one of the GPU torch reports (H200,
# H100-80GB, A100-40GB); peaks come from torch.cuda.max_memory_allocated (through
# fxopt.measure_peak). Results are written after every model; `timeout` stops the run at 7
# minutes, so partial results are always left in OUT_DIR.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT_DIR="${1:-${OUT:-benchmarks/results/fit_check_gpu}}"
mkdir -p "$OUT_DIR"

{
  gpu_env
} > "$OUT_DIR/env.txt" 2>&1

timeout -k 15 420 python -m benchmarks.fit_check --device cuda --profile auto \
  --models llama,gpt2 --budgets 1.0,0.5,min --size gpu \
  --out "$OUT_DIR/fit_check" > "$OUT_DIR/log.txt" 2>&1
status=$?
echo "exit status $status (124: stopped by timeout; results so far are in $OUT_DIR)" | tee -a "$OUT_DIR/log.txt"
ls -l "$OUT_DIR"
exit 0
