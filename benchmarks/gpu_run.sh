#!/usr/bin/env bash
# The Pareto benchmark, reduced, on one CUDA GPU in under 8 minutes (prepared for the GPU machine
# the tool library lends to some tasks; not yet run on a GPU).
#
#   benchmarks/gpu_run.sh [OUT_DIR]        # default: $OUT, else benchmarks/results/pareto_gpu
#   benchmarks/gpu_run.sh offload [...]    # the OFFLOAD benchmark instead (benchmarks/gpu_offload.sh;
#                                          # its own 8 minutes: the two do not fit one 15-minute lease)
#
# Run from the repository root. Peaks come from torch.cuda.max_memory_allocated (through
# fxopt.measure_peak). Every row is written as soon as it is measured; a failing row is recorded
# and the run goes on; no new row starts after the deadline (--deadline), and `timeout` stops
# the run for good shortly after, so partial results are always left in OUT_DIR.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
if [ "${1:-}" = "offload" ]; then
  shift
  exec benchmarks/gpu_offload.sh "$@"
fi
OUT_DIR="${1:-${OUT:-benchmarks/results/pareto_gpu}}"
mkdir -p "$OUT_DIR"

{
  gpu_env
  python -c "import fxopt, pulp, highspy, matplotlib; print('fxopt', fxopt.__version__, 'backend:', hasattr(fxopt, 'backend'))"
} > "$OUT_DIR/env.txt" 2>&1

# 7.5 minutes in all: rows start until 6 minutes, the process is stopped at 7.
timeout -k 15 420 python -m benchmarks.pareto \
  --quick --size full --device cuda \
  --models gpt2,bert,residual_mlp,resnet,unet \
  --methods eager,checkpoint,compile,inductor,fxopt,fxopt-inductor \
  --compile-budgets 1,0.5,0 --inductor-budgets 1 --fractions 1,0.5 \
  --fxopt-solvers checkpoint,greedy,auto --time-limit 10 --timed-steps 10 \
  --deadline 360 --out "$OUT_DIR" > "$OUT_DIR/log.txt" 2>&1
status=$?
echo "exit status $status (124: stopped by timeout; results so far are in $OUT_DIR)" | tee -a "$OUT_DIR/log.txt"
ls -l "$OUT_DIR"
exit 0
