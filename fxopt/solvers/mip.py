"""A small mixed-integer program in plain arrays, and the MIP solvers that solve it.

The rematerialization ILP (`fxopt.solvers.ilp`) is written once as a `Mip` and handed to a
solver:

  - ``highs``: HiGHS through ``highspy``, in process. The model is passed as arrays (tens of
    thousands of rows in well under a second), the warm start as a solution, and a callback
    reports progress (incumbent, bound, gap, elapsed) and stops the solve on Ctrl-C, keeping
    the best solution found.
  - ``cbc``: CBC, the solver that ships with PuLP, as a subprocess (no progress; its bound is
    not reported).

Both are bounded by counted work (`fxopt.solvers.effort`): branch-and-bound nodes, HiGHS's
progress checks, simplex iterations; HiGHS runs on one thread, so that the same limits give the
same answer on any machine. The time limit is a safety stop only (`MipResult.limit` says which
limit ended a solve), on the clock the caller gives (`Limits.clock`: the solvers give the
planning thread's CPU time), read at HiGHS's progress checks (`WALL_BACKSTOP`; CBC, a subprocess,
counts its own CPU seconds). Both return the best solution found and, where the solver gives it, the
proven lower bound on the objective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from fxopt.solvers.gap import gap

MIP_SOLVERS = ("highs", "cbc")


@dataclasses.dataclass(frozen=True)
class Progress:
    """A snapshot of a running solve: objective of the best solution so far (None before the
    first), the proven lower bound (None if unknown), their relative gap, seconds elapsed."""

    incumbent: float | None
    bound: float | None
    gap: float | None
    seconds: float


@dataclasses.dataclass(frozen=True)
class MipResult:
    status: str  # "optimal" | "feasible" (stopped with a solution) | "infeasible" | "stopped" (none found)
    x: tuple[float, ...] | None
    objective: float | None
    bound: float | None  # a proven lower bound on the objective (None when the solver gives none)
    seconds: float
    interrupted: bool = False  # stopped by the user (Ctrl-C)
    # What ended a solve short of its gap: "work" (its counted effort, or a target reached), "time"
    # (the safety stop: only then may another run answer otherwise), None (it finished).
    limit: str | None = None
    checks: int = 0  # HiGHS's progress checks it used


class Mip:
    """minimise cost·x + offset  s.t.  lo_r <= row_r·x <= hi_r,  lower <= x <= upper,  x_j integer
    for marked j. The constant ``offset`` matters to the solvers' relative gap, which is taken on the
    whole objective: a large constant would let them stop far from the optimum of what varies."""

    def __init__(self) -> None:
        self.offset: float = 0.0
        self.names: list[str] = []
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_start: list[int] = [0]
        self.row_index: list[int] = []
        self.row_value: list[float] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    @property
    def num_vars(self) -> int:
        return len(self.names)

    @property
    def num_integer(self) -> int:
        return sum(self.integer)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def binary(self, name: str, cost: float = 0.0, lower: float = 0.0) -> int:
        return self.var(name, cost=cost, lower=lower, upper=1.0, integer=True)

    def var(self, name: str, *, cost: float = 0.0, lower: float = 0.0, upper: float = float("inf"),
            integer: bool = False) -> int:
        self.names.append(name)
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.names) - 1

    def row(self, terms: Iterable[tuple[int, float]], lower: float = float("-inf"), upper: float = float("inf")) -> None:
        merged: dict[int, float] = {}
        for j, a in terms:
            merged[j] = merged.get(j, 0.0) + a
        for j, a in merged.items():
            if a:
                self.row_index.append(j)
                self.row_value.append(a)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def objective(self, x: Iterable[float]) -> float:
        return self.offset + sum(c * v for c, v in zip(self.cost, x))

    def violations(self, x: list[float], tol: float = 1e-6) -> list[int]:
        """Rows that ``x`` breaks (for tests and warm starts)."""
        bad = []
        for r in range(self.num_rows):
            lo, hi = self.row_start[r], self.row_start[r + 1]
            v = sum(self.row_value[k] * x[self.row_index[k]] for k in range(lo, hi))
            if v < self.row_lower[r] - tol or v > self.row_upper[r] + tol:
                bad.append(r)
        return bad


def byte_unit(graph) -> int:
    """A power of two that brings the step's total bytes to about 4096 units (1 for tiny graphs):
    memory rows in these units keep the coefficients within a few orders of magnitude (HiGHS calls
    a budget of 4e9 bytes "badly scaled" and may then declare feasible problems infeasible)."""
    total = sum(n.bytes for n in graph.nodes)
    unit = 1
    while total // (unit * 2) >= 4096:
        unit *= 2
    return unit


def cost_scale_for(costs: Iterable[float]) -> float:
    """The factor that makes the largest of ``costs`` 1000 in an objective (1 when none is positive)."""
    top = max(costs, default=0.0)
    return 1000.0 / top if top > 0 else 1.0


def default_mip_solver() -> str:
    """HiGHS when ``highspy`` is installed (several times faster than CBC on these problems, and
    it reports bounds and progress: see benchmarks/solvers.py), else CBC, which ships with PuLP."""
    return "highs" if importlib.util.find_spec("highspy") is not None else "cbc"


# Where the safety stop has a clock of its own (`Limits.clock`: the planning thread's CPU time,
# read at HiGHS's progress checks), HiGHS's own time limit, which is wall-clock, is this many times
# its seconds: a backstop for work between two checks (the root's LP) on a machine that gives the
# thread less than a tenth of a core; on any less loaded one the safety stop's clock stops first.
WALL_BACKSTOP = 10.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """The counted work one MIP solve may do (see `fxopt.solvers.effort`), and the time limit, a
    safety stop: ``seconds`` on ``clock`` (`fxopt.solvers.effort.now`, the planning thread's CPU
    time; None: the solver's own wall clock). None: no such limit."""

    seconds: float
    clock: Callable[[], float] | None = None
    nodes: int | None = None  # branch-and-bound nodes
    checks: int | None = None  # HiGHS's progress checks (calls of its interrupt callback)
    lp_iterations: int | None = None  # simplex iterations of an LP relaxation
    sub_mips: bool = True  # HiGHS's RINS and RENS heuristics


def solve_mip(
    model: Mip,
    *,
    limits: Limits,
    mip_solver: str | None = None,
    warm_start: list[float] | dict[int, float] | None = None,
    relax: bool = False,
    rel_gap: float = 1e-4,
    on_progress: Callable[[Progress], None] | None = None,
    verbose: bool = False,
    target: float | None = None,
) -> MipResult:
    """Solve ``model`` (its LP relaxation with ``relax``) within ``limits``; stop early once the
    relative gap is below ``rel_gap``, or (HiGHS) once a solution's objective is at most
    ``target`` (one known to be within reach of the optimum). ``warm_start``: every column's
    value, or some columns' values (a dict) for the solver to complete (HiGHS; CBC ignores a
    partial start). With no time left (``limits.seconds`` <= 0) nothing is solved: "stopped"."""
    mip_solver = mip_solver or default_mip_solver()
    if model.num_vars == 0:
        # Nothing to decide (the backward reads no forward value): HiGHS reports such a model
        # empty without solving it. Each row is the constant 0.
        if model.violations([]):
            return MipResult("infeasible", None, None, None, 0.0)
        return MipResult("optimal", (), 0.0, 0.0, 0.0)
    if limits.seconds <= 0:
        return MipResult("stopped", None, None, None, 0.0, limit="time")
    if mip_solver == "highs":
        clock = limits.clock or time.perf_counter
        t0 = clock()
        res = _solve_highs(model, limits, warm_start, relax, rel_gap, on_progress, verbose, target)
        if warm_start is not None and not relax and res.x is not None and not _solution_matches(model, res):
            # HiGHS (1.16) can report a better objective than the solution it returns, which is
            # then the warm start: solve again without it.
            left = dataclasses.replace(limits, seconds=max(limits.seconds - (clock() - t0), 0.01))
            res = _solve_highs(model, left, None, relax, rel_gap, on_progress, verbose, target)
        return _checked(model, res, rel_gap)
    if mip_solver == "cbc":
        return _solve_cbc(model, limits, warm_start, relax, rel_gap, verbose)
    raise ValueError(f"unknown MIP solver {mip_solver!r}; use one of {', '.join(MIP_SOLVERS)}")


def _solution_matches(model: Mip, res: MipResult) -> bool:
    return abs(model.objective(res.x) - res.objective) <= 1e-9 * max(1.0, abs(res.objective))


def _checked(model: Mip, res: MipResult, rel_gap: float) -> MipResult:
    """``res`` with its objective that of the solution it returns; "optimal" only if that
    solution is proven within ``rel_gap``."""
    if res.x is None or _solution_matches(model, res):
        return res
    objective = model.objective(res.x)
    status = res.status
    if status == "optimal" and not (res.bound is not None and gap(objective, res.bound) <= rel_gap):
        status = "feasible"
    return dataclasses.replace(res, status=status, objective=objective)


@contextlib.contextmanager
def _interruptible(on_interrupt: Callable[[], None]):
    """Turn Ctrl-C into a request to stop the solve (only possible from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        on_interrupt()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _solve_highs(model, limits: Limits, warm_start, relax, rel_gap, on_progress, verbose, target=None) -> MipResult:
    import highspy

    from fxopt._quiet import silenced

    t0 = time.perf_counter()
    stop = threading.Event()
    check = _Checks(stop, on_progress, t0, target, limits.checks, limits.clock,
                    limits.clock() + limits.seconds if limits.clock else None)
    # HiGHS prints a banner from C++ whatever its options say.
    with contextlib.nullcontext() if verbose else silenced(1):
        h = highspy.Highs()
        h.setOptionValue("output_flag", bool(verbose))
        wall = limits.seconds * (WALL_BACKSTOP if limits.clock else 1.0)
        h.setOptionValue("time_limit", float(max(wall, 0.01)))
        h.setOptionValue("mip_rel_gap", float(rel_gap))
        h.setOptionValue("threads", 1)
        if limits.nodes is not None:
            h.setOptionValue("mip_max_nodes", int(limits.nodes))
        if not limits.sub_mips:
            h.setOptionValue("mip_heuristic_run_rins", False)
            h.setOptionValue("mip_heuristic_run_rens", False)
        if relax:
            h.setOptionValue("solver", "simplex")
            if limits.lp_iterations is not None:
                h.setOptionValue("simplex_iteration_limit", int(limits.lp_iterations))
        _load_highs(h, model, relax)
        if warm_start is not None and not relax:
            _start_highs(h, warm_start)
        if not relax:
            h.cbMipInterrupt.subscribe(check)
        with _interruptible(stop.set):
            _run_on_one_thread(h)
        status = h.getModelStatus()
        info = h.getInfo()
    seconds = time.perf_counter() - t0
    S = highspy.HighsModelStatus
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = tuple(h.getSolution().col_value) if has_solution else None
    objective = info.objective_function_value if has_solution else None
    if relax:
        bound = objective if status == S.kOptimal else None
    else:
        bound = _finite(info.mip_dual_bound)
    if status == S.kOptimal:
        name = "optimal"
    elif status in (S.kInfeasible, S.kUnboundedOrInfeasible):
        name = "infeasible"
    else:
        name = "feasible" if x is not None else "stopped"
    limit = None
    if status == S.kTimeLimit or check.timed_out:
        limit = "time"
    elif status in (S.kSolutionLimit, S.kIterationLimit) or status == S.kInterrupt and not stop.is_set():
        limit = "work"
    if on_progress is not None and not relax:
        on_progress(Progress(objective, bound, gap(objective, bound), seconds))
    return MipResult(name, x, objective, bound, seconds, interrupted=stop.is_set(), limit=limit, checks=check.count)


def _run_on_one_thread(h) -> None:
    """``h.run()`` on one thread. HiGHS keeps one thread pool per process: where another caller
    started it with more threads, it refuses ours, so it is started again (its own advice)."""
    import highspy

    if h.run() == highspy.HighsStatus.kError and h.getModelStatus() == highspy.HighsModelStatus.kNotset:
        highspy.Highs.resetGlobalScheduler(True)
        h.run()


def _load_highs(h, model: Mip, relax: bool) -> None:
    """Columns, rows and integrality of ``model``, as arrays."""
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    h.addCols(model.num_vars, np.asarray(model.cost, dtype=np.float64),
              np.asarray([max(v, -inf) for v in model.lower], dtype=np.float64),
              np.asarray([min(v, inf) for v in model.upper], dtype=np.float64),
              0, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64))
    h.addRows(model.num_rows,
              np.asarray([max(v, -inf) for v in model.row_lower], dtype=np.float64),
              np.asarray([min(v, inf) for v in model.row_upper], dtype=np.float64),
              len(model.row_index), np.asarray(model.row_start[:-1], dtype=np.int32),
              np.asarray(model.row_index, dtype=np.int32), np.asarray(model.row_value, dtype=np.float64))
    h.changeObjectiveOffset(float(model.offset))
    ints = [j for j in range(model.num_vars) if model.integer[j]]
    if ints and not relax:
        h.changeColsIntegrality(len(ints), np.asarray(ints, dtype=np.int32),
                                np.asarray([highspy.HighsVarType.kInteger] * len(ints)))


def _start_highs(h, warm_start: list[float] | dict[int, float]) -> None:
    import highspy
    import numpy as np

    if isinstance(warm_start, dict):
        if warm_start:  # a partial solution: HiGHS completes it with a small sub-MIP
            idx = np.asarray(sorted(warm_start), dtype=np.int32)
            h.setSolution(len(idx), idx, np.asarray([warm_start[j] for j in sorted(warm_start)], dtype=np.float64))
        return
    sol = highspy.HighsSolution()
    sol.col_value = list(map(float, warm_start))
    sol.value_valid = True
    h.setSolution(sol)


class _Checks:
    """HiGHS's MIP interrupt callback: stop at the ``most``-th call (the counted work: with one
    thread HiGHS calls it at the same places on every run), when ``stop`` is set (Ctrl-C), when a
    solution reaches ``target``, or once the safety stop's ``clock`` (`Limits.clock`, if any)
    reads ``stop_at`` (``timed_out``); `Progress` about once a second."""

    def __init__(self, stop: threading.Event, on_progress: Callable[[Progress], None] | None, t0: float,
                 target: float | None, most: int | None, clock: Callable[[], float] | None,
                 stop_at: float | None):
        self.stop, self.on_progress, self.t0, self.target, self.most = stop, on_progress, t0, target, most
        self.clock, self.stop_at = clock, stop_at
        self.count = 0
        self.last_report = 0.0
        self.timed_out = False

    def __call__(self, event) -> None:
        self.count += 1
        incumbent = _finite(event.data_out.mip_primal_bound)
        self.timed_out = self.timed_out or self.clock is not None and self.clock() >= self.stop_at
        if (self.stop.is_set() or self.timed_out or self.most is not None and self.count >= self.most
                or self.target is not None and incumbent is not None and incumbent <= self.target):
            event.interrupt()
        if self.on_progress is None:
            return
        seconds = time.perf_counter() - self.t0
        if seconds - self.last_report < 1.0:
            return
        self.last_report = seconds
        bound = _finite(event.data_out.mip_dual_bound)
        self.on_progress(Progress(incumbent, bound, gap(incumbent, bound), seconds))


def _finite(value: float) -> float | None:
    """HiGHS's objective or bound, None where it has none (it reports infinity)."""
    return value if abs(value) < 1e300 else None


def _solve_cbc(model, limits: Limits, warm_start, relax, rel_gap, verbose) -> MipResult:
    import pulp

    t0 = time.perf_counter()
    prob = pulp.LpProblem("fxopt", pulp.LpMinimize)
    xs = []
    for j in range(model.num_vars):
        lo = model.lower[j] if model.lower[j] > float("-inf") else None
        hi = model.upper[j] if model.upper[j] < float("inf") else None
        cat = pulp.LpInteger if model.integer[j] and not relax else pulp.LpContinuous
        xs.append(pulp.LpVariable(f"x{j}", lowBound=lo, upBound=hi, cat=cat))
    prob += pulp.LpAffineExpression([(xs[j], c) for j, c in enumerate(model.cost) if c], constant=model.offset)
    for r in range(model.num_rows):
        lo, hi = model.row_start[r], model.row_start[r + 1]
        expr = pulp.LpAffineExpression([(xs[model.row_index[k]], model.row_value[k]) for k in range(lo, hi)])
        if model.row_lower[r] == model.row_upper[r]:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, rhs=model.row_lower[r])
            continue
        if model.row_lower[r] > float("-inf"):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, rhs=model.row_lower[r])
        if model.row_upper[r] < float("inf"):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, rhs=model.row_upper[r])
    full_start = warm_start is not None and not isinstance(warm_start, dict) and not relax
    if full_start:
        for v, x0 in zip(xs, warm_start):
            v.setInitialValue(x0)
    solver = pulp.PULP_CBC_CMD(msg=verbose, timeLimit=max(1, int(round(limits.seconds))), timeMode="cpu", threads=1,
                               warmStart=full_start, gapRel=rel_gap, maxNodes=limits.nodes)
    cpu0 = _children_cpu()
    prob.solve(solver)
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        x = tuple(float(v.varValue or 0.0) for v in xs)
        objective = model.objective(x)
        optimal = prob.sol_status == pulp.LpSolutionOptimal
        # (CBC does not say which limit stopped it: past its time limit in CPU seconds, that one.)
        limit = None if optimal else "time" if cpu >= limits.seconds else "work"
        return MipResult("optimal" if optimal else "feasible", x, objective,
                         objective if optimal and relax else None, seconds, limit=limit)
    status = "infeasible" if prob.status == pulp.LpStatusInfeasible else "stopped"
    return MipResult(status, None, None, None, seconds, limit=None if status == "infeasible" else "work")


def _children_cpu() -> float:
    """CPU seconds the finished subprocesses of this process have used (CBC's)."""
    times = os.times()
    return times.children_user + times.children_system
