"""Does it fit (`fxopt.fit`): one answer for a model's training step on a device, planned without the device.

    found = fxopt.fit(model, example_inputs, device="H100-80GB")   # budget: the device's memory
    print(found)                                                    # one table

Three questions, each asked of fxopt's own entry points on fake tensors for the device's profile
(`fxopt.devices`; ``device=`` of `fxopt.plan`), nothing run:

  1. the smallest budget fxopt reaches (`fxopt.plan` at ``"min"``), beside the proven floor no
     schedule goes below (`fxopt.solvers.instant.peak_lower_bound`) and eager's predicted peak;
  2. at the budget (the device's memory, or the one given): the plan, and what it costs in
     recomputation (the cost model's estimated seconds at the profile's rates), or that it does
     not fit;
  3. the largest batch that fits the budget (`fxopt.max_batch`, which searches one capture with
     the batch symbolic), beside eager's and per-block checkpointing's.

Each answer is only as good as the profile's: every storage rounded to the allocator's blocks,
the cuBLAS workspace resident, the scratch of ops not known to allocate only their outputs a
formula bound (`Fit.planned_for` says which). The step is captured twice: once for the two plans
(`fxopt.plan_ahead.plan_each`: each plans its own copy of one capture, and a graph both analyse,
the step as captured and as rewritten for planning, is analysed once: `fxopt.planner.Analyses`),
once with the batch symbolic for the batch. ``Fit.seconds`` says what each took.
"""

from __future__ import annotations

import dataclasses
import io
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from fxopt.budget import Budget, BudgetLike
from fxopt.devices import DeviceProfile, load as load_device
from fxopt.errors import BudgetError, InfeasibleBudgetError
from fxopt.maxbatch import MaxBatch, max_batch
from fxopt.options import Options, check_names
from fxopt.plan_ahead import plan_each
from fxopt.solvers.auto import SolverTimeoutWarning
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.plan import Plan
from fxopt.units import format_bytes


@dataclasses.dataclass(frozen=True)
class Fit:
    """What `fit` found for one step on one device (all peaks predicted, in bytes).

    ``budget_bytes``: the device's memory, or the budget given (``budget_given``).
    ``eager_peak_bytes``: the step as eager autograd runs it. ``min_budget_bytes``: the smallest
    budget fxopt planned (``min_plan``); ``floor_bytes``: no schedule of any kind goes below it
    (proven), so their difference (`min_gap`) is all recomputation could still win.
    ``min_stopped``: the safety stop (``time_limit``) cut that search short (another run may go
    lower). ``plan``: the plan at ``budget_bytes`` (None: nothing fxopt found fits it).
    ``step_cost``: the step run once, in the cost model's estimated seconds (what ``plan.cost``
    adds to). ``largest``: `fxopt.max_batch`'s answer at ``budget_bytes`` (None where not even
    batch 1 fits: then ``largest_error`` says why), ``batch`` the example inputs' batch.
    ``planned_for``: how the memory was counted (`fxopt.devices.DeviceProfile.planning_note`).
    ``seconds``: wall time of the plans' capture and of each question (the largest batch's
    capture included)."""

    device: str
    budget_bytes: int
    budget_given: bool
    batch: int | None
    eager_peak_bytes: int
    min_budget_bytes: int
    floor_bytes: int
    min_stopped: bool
    min_plan: Plan
    plan: Plan | None
    step_cost: float
    largest: MaxBatch | None
    largest_error: str
    planned_for: str
    seconds: dict[str, float]

    @property
    def fits(self) -> bool:
        """Whether fxopt plans the step within the budget."""
        return self.plan is not None

    @property
    def min_gap(self) -> float:
        """(smallest budget - floor) / smallest budget: how much lower a budget could still be met."""
        return (self.min_budget_bytes - self.floor_bytes) / self.min_budget_bytes if self.min_budget_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The answer's numbers, JSON-ready (the plans left out: `Plan.to_json` writes one)."""
        plan, found = self.plan, self.largest
        return {
            "device": self.device, "budget_bytes": self.budget_bytes, "budget_given": self.budget_given,
            "batch": self.batch, "eager_peak_bytes": self.eager_peak_bytes, "min_budget_bytes": self.min_budget_bytes,
            "floor_bytes": self.floor_bytes, "min_gap": self.min_gap, "min_stopped": self.min_stopped,
            "fits": self.fits, "peak_bytes": None if plan is None else plan.peak_bytes,
            "recompute_flops": None if plan is None else plan.recompute_flops,
            "cost_seconds": None if plan is None else plan.cost, "step_cost_seconds": self.step_cost,
            "largest_batch": None if found is None else found.batch,
            "largest_batch_proven_max": None if found is None else found.proven_max,
            "eager_batch": None if found is None else found.eager_batch,
            "checkpoint_batch": None if found is None else found.checkpoint_batch,
            "largest_batch_stopped": [] if found is None else list(found.stopped),
            "planned_for": self.planned_for, "seconds": self.seconds,
        }

    def rows(self) -> list[tuple[str, str]]:
        """The table's rows: (question, answer)."""
        budget = self.budget_bytes
        where = "the budget given" if self.budget_given else f"{self.device}'s memory"
        rows = [("budget", f"{format_bytes(budget)} ({where}; {budget} bytes)"),
                ("eager autograd", f"peak {format_bytes(self.eager_peak_bytes)}: "
                 + ("fits" if self.eager_peak_bytes <= budget else f"{format_bytes(self.eager_peak_bytes - budget)} over"))]
        cut = ("" if not self.min_stopped else "; the time limit cut the search short, at the floor all the same"
               if self.min_budget_bytes == self.floor_bytes else "; cut short by the time limit (another run may go lower)")
        rows.append(("smallest budget fxopt reaches",
                     f"{format_bytes(self.min_budget_bytes)} (proven floor {format_bytes(self.floor_bytes)}: within "
                     f"{100 * self.min_gap:.1f}% of it){cut}; there {_recomputed(self.min_plan)}"
                     + _offloaded(self.min_plan)))
        if self.plan is None:
            rows.append((f"at {format_bytes(budget)}", f"does not fit: needs at least {format_bytes(self.min_budget_bytes)}"))
        else:
            plan = self.plan
            share = f" (+{100 * plan.cost / self.step_cost:.1f}% of the step's {1e3 * self.step_cost:.3g} ms)" \
                if self.step_cost else ""
            rows.append((f"at {format_bytes(budget)}",
                         f"fits: peak {format_bytes(plan.peak_bytes)}, {_recomputed(plan)}{share}" + _offloaded(plan)))
        rows.append(("largest batch", self._largest_batch()))
        rows.append(("how it was counted", self.planned_for))
        rows.append(("time", ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())))
        return rows

    def _largest_batch(self) -> str:
        """The largest-batch row. max_batch searches the batches its capture with the batch
        symbolic holds for (`MaxBatch.captured`), which may start above the example's batch (a
        capture sets a batch of 1 apart): below that, the example's own answers stand in."""
        example = self.batch if self.batch is not None else 1
        if self.largest is None:
            if not self.fits:
                return f"none: {self.largest_error}"
            return (f"fxopt {example}, the example's (planned above), and no batch max_batch searched fits "
                    f"({self.largest_error.splitlines()[0]}); eager {example if self.eager_peak_bytes <= self.budget_bytes else 'none'}")
        found, lo = self.largest, self.largest.captured[0]

        def below(batch: int | None, fits_example: bool | None) -> str:
            """``batch`` (0: none in the range searched), with what is known below the range."""
            if batch is None:
                return "-"
            if batch or lo <= example:
                return str(batch)
            return {True: f"{example} (the example's; none from {lo} up)", False: "none"}.get(fits_example,
                                                                                             f"none from {lo} up")

        proof = ("the search limit" if found.batch == found.limit else "proven" if found.batch == found.proven_max
                 else f"none above {found.proven_max}, proven")
        cut = "; cut short by the time limit" if found.stopped else ""
        searched = f"; batches from {lo} searched" if lo > 1 else ""
        return (f"fxopt {found.batch} ({proof}; without OFFLOAD), eager "
                f"{below(found.eager_batch, self.eager_peak_bytes <= self.budget_bytes)}, per-block checkpointing "
                f"{below(found.checkpoint_batch, None)}; the example's {example}{searched}{cut}")

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"does it fit on {self.device}? (one training step, predicted)", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        for question, answer in self.rows():
            table.add_row(question, answer)
        text = io.StringIO()
        Console(file=text, width=120, no_color=True, highlight=False).print(table)
        return text.getvalue().rstrip()


def fit(model: nn.Module, example_inputs: Sequence[Any] | dict, *, device: str | DeviceProfile,
        budget: BudgetLike | None = None, dim: Any = "batch", limit: int = 2**16, **options: Any) -> Fit:
    """Whether ``model``'s training step on ``example_inputs`` fits ``device`` with fxopt, at what
    recompute cost, and the largest batch that does (see `fxopt.fitting` and `Fit`).
    ``device``: a profile (`fxopt.devices`: "H100-80GB", "A100-40GB", "H200", or a profile's JSON).
    ``budget``: bytes or a size ("70GiB"); None: the device's memory. ``dim``, ``limit``: the batch
    dimension and the largest batch searched, as for `fxopt.max_batch`. ``options``: the fields of
    `fxopt.Options` (``time_limit``, ``effort``, ``solver``, ...), for each question."""
    check_names(options)
    if options.get("plan") is not None:
        raise ValueError("fit plans the step anew for the device (a replayed plan answers none of its questions); "
                         "leave plan= out")
    profile = load_device(device)
    given = budget is not None
    if budget is None:
        if profile.memory_bytes is None:
            raise BudgetError(f"device {profile.name!r} has no fixed memory: give fit a budget (bytes, or a size such "
                              "as '16GiB')")
        budget = profile.memory_bytes
    budget_bytes = Budget.parse(budget).bytes
    if budget_bytes is None:
        raise BudgetError(f"fit needs the budget in bytes or as a size ('70GiB'), not {budget!r}: the question is "
                          "whether the step fits that much memory (fxopt.plan takes shares of the eager peak)")
    base = Options.of(budget_bytes, device=profile, **options)
    seconds: dict[str, float] = {}

    def ask(plan) -> tuple[Plan, bool, Plan | None]:
        """The two plans of one capture: at the smallest budget, and at the budget where that fits."""
        t0 = time.perf_counter()
        seconds["capture"] = t0 - started
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SolverTimeoutWarning)
            min_plan = plan(dataclasses.replace(base, budget=Budget.parse("min"))).plan
        stopped = any(issubclass(w.category, SolverTimeoutWarning) for w in caught)
        t1 = time.perf_counter()
        seconds["smallest budget"] = t1 - t0
        at_budget = None
        if min_plan.budget_bytes <= budget_bytes:
            try:
                at_budget = plan(base).plan
            except InfeasibleBudgetError:  # (a budget the "min" search met, missed by the search at it)
                at_budget = None
        seconds["at the budget"] = time.perf_counter() - t1
        return min_plan, stopped, at_budget

    started = time.perf_counter()
    min_plan, stopped, plan = plan_each(model, base, example_inputs, ask, plan_only=True)

    t0 = time.perf_counter()
    largest, why = None, ""
    try:
        largest = max_batch(model, dataclasses.replace(base, offload=False), lambda b: at_batch(example_inputs, b),
                            dim=dim, limit=limit)
    except InfeasibleBudgetError as err:
        why = str(err)
    seconds["largest batch"] = time.perf_counter() - t0

    return Fit(device=profile.name, budget_bytes=budget_bytes, budget_given=given, batch=_batch_of(example_inputs),
               eager_peak_bytes=min_plan.eager_peak_bytes, min_budget_bytes=min_plan.budget_bytes,
               floor_bytes=peak_lower_bound(min_plan.graph)[0], min_stopped=stopped, min_plan=min_plan, plan=plan,
               step_cost=sum(n.cost for n in min_plan.graph.nodes), largest=largest, largest_error=why,
               planned_for=min_plan.planned_for, seconds=seconds)


def _offloaded(plan: Plan) -> str:
    return f", {len(plan.offloaded)} values offloaded ({format_bytes(plan.host_bytes)} on the host)" if plan.offloaded else ""


def _recomputed(plan: Plan) -> str:
    """What ``plan`` recomputes: how many ops, their FLOPs (matrix products and the like: elementwise
    ops count none) and the cost model's estimated milliseconds (memory traffic included)."""
    n, flops = sum(plan.recomputed.values()), plan.recompute_flops
    counted = f"+{flops / 1e12:.2f} TFLOP" if flops >= 1e12 else f"+{flops / 1e9:.3f} GFLOP"
    return f"{n} ops recomputed ({counted}, {1e3 * plan.cost:.3g} ms estimated)"


def _batch_of(inputs: Any) -> int | None:
    """The first tensor's dim 0 in ``inputs`` (None if no tensor has one)."""
    values = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs.values()) if isinstance(inputs, dict) \
        else list(inputs)
    return next((v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim()), None)


def at_batch(inputs: Any, b: int) -> Any:
    """``inputs`` with every tensor of the same dim 0 as the first one repeated or cut to ``b``."""
    n = _batch_of(inputs)

    def resize(v):
        if not (isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n):
            return v
        return v.repeat(-(-b // n), *[1] * (v.dim() - 1))[:b].clone()

    if isinstance(inputs, dict):
        return {k: resize(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return resize(inputs)
    return tuple(map(resize, inputs))
