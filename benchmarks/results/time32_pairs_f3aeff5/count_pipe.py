import os, sys, json, time
os.environ["FXOPT_CACHE"] = "0"
from fxopt.solvers import phases
n = {"instant": 0}
real = phases.instant_solve
def counted(*a, **k):
    n["instant"] += 1
    return real(*a, **k)
phases.instant_solve = counted
from benchmarks import planning_time as pt
row = pt.pipeline_answer(int(sys.argv[1]), int(sys.argv[2]))
print(n, row["digest"], row["budget"], row["cuts"], row["solvers"], round(row["cpu_s"], 2), row["work"])
