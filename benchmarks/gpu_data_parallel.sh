#!/usr/bin/env bash
# fxopt under DDP and FSDP2 on CUDA GPUs over NCCL (benchmarks/data_parallel.py), in under 9
# minutes: world size 1 (one GPU: NCCL still runs DDP's reducer and FSDP2's collectives), then,
# where the machine has several GPUs, one process per GPU. Prepared for the GPU machine the tool
# library lends to some tasks; not yet run on a GPU.
#
#   benchmarks/gpu_data_parallel.sh [OUT_DIR]    # default: $OUT, else benchmarks/results/data_parallel_gpu
#
# Run from the repository root. Peaks come from torch.cuda.max_memory_allocated (through
# fxopt.measure_peak), per rank. Each world size writes its own results (world1.md/.json,
# worldN.md/.json) when it completes; `timeout` stops a run for good, and its log says so.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-benchmarks/results/data_parallel_gpu}}"
mkdir -p "$OUT_DIR"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

{
  date -Is
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi 2>&1 | head -15
  echo "GPUs: $GPUS"
  python -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  python -c "import fxopt, transformers, highspy; print('fxopt', fxopt.__version__, 'transformers', transformers.__version__)"
} > "$OUT_DIR/env.txt" 2>&1

# One world size: DDP and FSDP2 rows (eager, per-block checkpointing, fxopt at checkpointing's
# peak and at "min" or eager's peak), the Llama of the CPU runs. $2: seconds before `timeout`.
run() {
  local world=$1 limit=$2
  timeout -k 15 "$limit" python -m benchmarks.data_parallel --device cuda --backend nccl --world "$world" \
    --time-limit 60 --timed-steps 10 --out "$OUT_DIR/world$world" > "$OUT_DIR/world$world.log" 2>&1
  echo "world $world: exit status $? (124: stopped by timeout)" | tee -a "$OUT_DIR/world$world.log"
}

run 1 300
if [ "$GPUS" -gt 1 ]; then
  run "$GPUS" 240
fi
ls -l "$OUT_DIR"
exit 0
