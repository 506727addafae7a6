"""Plans cached on disk, so planning the same step again does not solve again.

A plan is stored under a key made of everything its solve depends on: the whole solver graph
(nodes, sizes, measured scratch memory, costs: so a plan made on another machine or torch
version, whose kernels allocate differently, is not reused), the budget in bytes, the solver,
its effort (`fxopt.solvers.Effort`: counted work decides the plan, not the time limit, and a plan
the time limit cut short is not stored), fxopt's version and the solvers' revision
(`fxopt.solvers.REVISION`). Directory: ``$FXOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxopt/plans``
(``~/.cache/fxopt/plans``). ``FXOPT_CACHE=0`` turns it off. A cache entry that cannot be read is
ignored and replaced. (The planner passes the cache by for a plan that SAVEs everything in the
captured order, whose solve costs no more than its key: `fxopt.planner._through_cache`.)

Beside the plans, in memory, `lowest_peaks`: the lowest-peak schedules the solvers found for the
graphs planned in this process (`fxopt.solvers.minimum.Memo`), which the planner passes to every
solve. It only saves time: a hit is what the search would find again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from fxopt._version import __version__
from fxopt.solvers import REVISION
from fxopt.solvers.effort import DEFAULT_EFFORT, Effort
from fxopt.solvers.graph import Graph
from fxopt.solvers.minimum import Memo
from fxopt.solvers.plan import Plan

log = logging.getLogger("fxopt")

lowest_peaks = Memo()


def enabled() -> bool:
    return os.environ.get("FXOPT_CACHE", "1").strip().lower() not in ("0", "false", "no", "off", "")


def directory() -> Path:
    if os.environ.get("FXOPT_CACHE_DIR"):
        return Path(os.environ["FXOPT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fxopt" / "plans"


def key(graph: Graph, budget: int, solver: str, effort: Effort = DEFAULT_EFFORT) -> str:
    payload = json.dumps([graph.to_dict(), budget, solver, effort.key(), __version__, REVISION], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def load(cache_key: str) -> Plan | None:
    if not enabled():
        return None
    path = directory() / f"{cache_key}.json"
    if not path.exists():
        return None
    try:
        plan = Plan.from_json(path)
    except Exception as err:  # noqa: BLE001 - a damaged or outdated entry: solve again
        log.info("fxopt: ignoring unreadable cached plan %s (%s)", path, err)
        return None
    log.info("fxopt: plan read from the cache (%s)", path)
    return plan


def store(cache_key: str, plan: Plan) -> None:
    if not enabled():
        return
    path = directory() / f"{cache_key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        # (Not `Plan.to_json`'s indented text: json writes indented text in Python, not in C, and
        # a 32-layer step's plan, 7,600 nodes, took 0.4-0.5 s to write so. `load` reads either.)
        tmp.write_text(json.dumps(plan.to_dict()))
        tmp.replace(path)
    except OSError as err:  # a read-only home directory must not break planning
        log.info("fxopt: could not cache the plan in %s (%s)", path, err)


def write_table(path: Path, entries: dict, what: str) -> None:
    """``entries`` as JSON at ``path``, whole or not at all (written beside it, then moved over
    it, so a process reading it meanwhile sees the old table or the new one). A directory that
    cannot be written is logged, not raised: a read-only cache must not break planning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{id(entries)}.tmp")
        tmp.write_text(json.dumps(entries, sort_keys=True))
        tmp.replace(path)
    except OSError as err:
        log.info("fxopt: could not cache %s in %s (%s)", what, path, err)
