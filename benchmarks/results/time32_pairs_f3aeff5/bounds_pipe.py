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
row = pt.pipeline_answer(48, 8)
p = got["plan"]
print("instant programs", n["instant"], "digest", row["digest"], "bounds", [repr(s.plan.lower_bound_cost) for s in p.stages], [s.plan.status for s in p.stages])
