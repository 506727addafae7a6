#!/bin/bash
set -x
OUT=/work/wt/time32/benchmarks/results/time32_pairs_f3aeff5
run() { (cd $1 && echo "$(date -u +%T) load $(cat /proc/loadavg)" && FXOPT_CACHE=0 PYTHONPATH=. .venv/bin/python -m benchmarks.planning_time $2 --out $OUT/$3 2>&1 | grep -E '^\{' ; echo "$(date -u +%T) load $(cat /proc/loadavg)") > /tmp/time32/log_$3.txt; }
run /work/wt/time32 "--depth 32" 7_depth32_time32
run /tmp/time32/base "--depth 32" 8_depth32_main_ac8c87e
run /tmp/time32/base "--pipeline 48 --stages 8" 9_pipeline48x8_main_ac8c87e
run /work/wt/time32 "--pipeline 48 --stages 8" 10_pipeline48x8_time32
