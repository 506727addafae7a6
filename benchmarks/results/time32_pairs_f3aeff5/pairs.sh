#!/bin/bash
# main (ac8c87e, a clean clone) then the branch, back to back, plan cache off
set -x
OUT=/work/wt/time32/benchmarks/results/time32_pairs_f3aeff5
mkdir -p $OUT
run() { (cd $1 && echo "$(date -u +%T) load $(cat /proc/loadavg)" && FXOPT_CACHE=0 PYTHONPATH=. .venv/bin/python -m benchmarks.planning_time $2 --out $OUT/$3 2>&1 | grep -E '^\{' ; echo "$(date -u +%T) load $(cat /proc/loadavg)") > /tmp/time32/log_$3.txt; }
run /tmp/time32/base "--pipeline 48 --stages 8" 1_pipeline48x8_main_ac8c87e
run /work/wt/time32 "--pipeline 48 --stages 8" 2_pipeline48x8_time32
run /tmp/time32/base "--depth 32" 3_depth32_main_ac8c87e
run /work/wt/time32 "--depth 32" 4_depth32_time32
run /work/wt/time32 "--pipeline 48 --stages 8" 5_pipeline48x8_time32
run /tmp/time32/base "--pipeline 48 --stages 8" 6_pipeline48x8_main_ac8c87e
