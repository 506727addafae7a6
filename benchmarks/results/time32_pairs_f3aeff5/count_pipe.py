"""Instant programs solved while planning issue 27's pipeline (`python count_pipe.py 48 8` from
the repository root, PYTHONPATH=.): the count and the answer's row; then (the format of
`bounds_main.txt` / `bounds_branch.txt`) the count, the digest and each stage plan's bound and
status."""
import os, sys
os.environ["FXOPT_CACHE"] = "0"
from fxopt.solvers import phases
n = {"instant": 0}
real = phases.instant_solve
def counted(*a, **k):
    n["instant"] += 1
    return real(*a, **k)
phases.instant_solve = counted
import benchmarks.budget_holds as bh
got = {}
realdig = bh.pipeline_digest
def cap(plan):
    got["plan"] = plan
    return realdig(plan)
bh.pipeline_digest = cap
from benchmarks import planning_time as pt
row = pt.pipeline_answer(int(sys.argv[1]), int(sys.argv[2]))
print(n, row["digest"], row["budget"], row["cuts"], row["solvers"], round(row["cpu_s"], 2), row["work"])
p = got["plan"]
print("instant programs", n["instant"], "digest", row["digest"], "bounds", [repr(s.plan.lower_bound_cost) for s in p.stages], [s.plan.status for s in p.stages])
