"""Solvers: (graph, budget in bytes) -> Solution. Plain numbers in and out; no torch.

The whole package imports without torch (a test blocks ``import torch`` and imports it):

  - `graph`: the solver graph (`Graph`, `Node`): values, sizes, costs, codecs, and optionally the
    bandwidths to and from host memory that OFFLOAD needs (`transfers`: `Transfers`, the copy
    channels the simulator times).
  - `liveness`: the memory model (reference counts on storage, last uses) that the simulator, the
    ILP and the instant program's bound all count with.
  - `schedule`: a `Schedule` (what is SAVEd, RECOMPUTEd, COMPRESSed, OFFLOADed), `simulate`, which
    replays it op by op and gives its `Timeline` (the peak the generated code will have, and the
    time the backward waits for offloaded values), and `OnDemand`, the backward that recomputes
    what is missing before each node.
  - `heuristics`, `chain`, `instant`, `ilp` (on `mip`): the solvers; `gap`: how far a plan may be
    from optimal, one definition for all of them; `policies`: the simple policies a user already
    has (checkpoint each repeated block, selective checkpointing), candidates of ``"auto"``.
  - `effort`: the counted work a solve may do (`Effort`), and the time limit, a safety stop.
  - `auto`: `solve`, the one entry point; `phases`: the strategies it runs, as tables of phases
    over one `search.Search`; `minimum`: the smallest budget that plans (`lowest_plan`, its
    `Memo`) and the answer "infeasible".
  - `blocks`: a step's repeated blocks found (identical segments of a chain); `block_plan`: each
    kind solved once, the copies' decisions chosen by dynamic programming, "auto"'s first phase;
    `block_rotor`: that program (rotor's, over menus of plans: a copy runs a plan of its kind's
    curve, or is made again from an earlier copy's input before its backward).
  - `plan`: `Plan`, a solution as the user sees it (decisions, peak, costs; JSON).
  - `stages`: pipeline stage cuts and each stage's plan; `stage_plan`: `PipelinePlan`.
"""

from fxopt.solvers.auto import (DEFAULT_TIME_LIMIT, ILP_REL_GAP, REVISION, SOLVERS, Solution, SolverTimeoutWarning,
                                check_solver, eager_schedule, eager_timeline, lowest_plan, lowest_schedule,
                                min_feasible_budget, solve)
from fxopt.solvers.effort import DEFAULT_EFFORT, Effort
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.minimum import Memo
from fxopt.solvers.schedule import Schedule, Timeline, simulate
from fxopt.solvers.transfers import Transfers

__all__ = ["Graph", "Node", "Transfers", "Schedule", "Timeline", "Solution", "SolverTimeoutWarning", "SOLVERS", "REVISION",
           "DEFAULT_TIME_LIMIT", "DEFAULT_EFFORT", "Effort", "ILP_REL_GAP", "Memo", "check_solver", "solve",
           "min_feasible_budget", "lowest_plan", "lowest_schedule", "simulate", "eager_schedule", "eager_timeline"]
