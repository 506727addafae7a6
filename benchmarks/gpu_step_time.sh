#!/usr/bin/env bash
# benchmarks.step_time on one CUDA GPU in under 8 minutes (issue 28; prepared for the GPU machine
# the tool library lends to some tasks; not yet run on a GPU).
#
#   benchmarks/gpu_step_time.sh [OUT_DIR]        # default: $OUT, else benchmarks/results/step_time_gpu
#
# Run from the repository root. Peaks come from torch.cuda.max_memory_allocated (through
# fxopt.measure_peak). Results are written after every model; `timeout` stops the run at 7
# minutes, so partial results are always left in OUT_DIR (Llama first: issue 24's overrun model).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT_DIR="${1:-${OUT:-benchmarks/results/step_time_gpu}}"
mkdir -p "$OUT_DIR"

{
  gpu_env
} > "$OUT_DIR/env.txt" 2>&1

timeout -k 15 420 python -m benchmarks.step_time --device cuda \
  --models hf-llama,hf-gpt2 \
  --variants eager,compile,fxopt-inductor@1.0,fxopt-inductor@hf,compile-amb,hf-ckpt-compile \
  --amb 0.5 --steps 21 --out "$OUT_DIR/step_time" > "$OUT_DIR/log.txt" 2>&1
status=$?
echo "exit status $status (124: stopped by timeout; results so far are in $OUT_DIR)" | tee -a "$OUT_DIR/log.txt"
ls -l "$OUT_DIR"
