"""How to plan a step: `Options`, one frozen schema that every entry point takes.

    fxopt.optimize(model, "2GiB", solver="ilp", offload=False)          # its fields by keyword
    fxopt.optimize(model, fxopt.Options(budget="2GiB", solver="ilp"))   # or the whole of it
    fxopt.plan(model, "min", (x,))                                      # the same for plan, pipeline,
    torch.compile(model, backend="fxopt", options={"budget": "2GiB"})   # max_batch, the backend
    fxopt inspect MODEL --budget 2GiB --solver ilp                      # and the command line

Each field is declared once, below, with what it means (``doc``), how a value is checked and
normalised (``check``, run when the options are made: a bad value fails at the call that gives
it, not at the first step) and, where it has one, its command-line flag (`Flag`: the CLI's flags
are made from these). docs/api.md's table of options is tested against the fields. Adding an
option is adding a field here, plus its line in that table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fxopt.analysis.costs import CostModel
from fxopt.analysis.codecs import QUANTIZE_FORMATS, Quantize, resolve_quantize
from fxopt.budget import Budget, BudgetLike
from fxopt.devices import DeviceProfile, load as load_device
from fxopt.errors import BudgetError, check_choice
from fxopt.solvers import DEFAULT_TIME_LIMIT, SOLVERS, check_solver
from fxopt.solvers.mip import MIP_SOLVERS
from fxopt.solvers.plan import Plan
from fxopt.solvers.stages import InFlight

COMPILERS = ("eager", "inductor")


@dataclasses.dataclass(frozen=True)
class Flag:
    """An option's flag on the command line (``fxopt demo``, ``fxopt inspect``): ``--NAME`` (the
    field's name, dashed) taking a value read by ``parse`` (the text as it is by default) or one of
    ``choices``; ``negate``: a flag ``--no-NAME`` that sets a bool option False. ``default``: the
    command line's own, where it differs from the field's; ``help``: instead of the field's doc's
    first sentence."""

    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    negate: bool = False
    default: Any = None
    help: str | None = None


def option(default: Any = dataclasses.MISSING, *, doc: str, check: Callable[[Any], Any] | None = None,
           flag: Flag | None = None, factory: Callable[[], Any] | None = None, internal: bool = False):
    """A field of `Options`: ``doc`` what it means, ``check(value)`` the value checked and
    normalised, ``flag`` its command-line flag (None: not on the command line); ``internal``: set
    by fxopt's own entry points, not by users."""
    metadata = {"doc": " ".join(doc.split()), "check": check, "flag": flag, "internal": internal}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _solver(value: str) -> str:
    check_solver(value)
    return value


def _mip_solver(value: str | None) -> str | None:
    if value is not None:
        check_choice("mip_solver", value, MIP_SOLVERS)
    return value


def _compiler(value: str) -> str:
    check_choice("compiler", value, COMPILERS)
    return value


def _plan(value: Plan | str | Path | None) -> Plan | None:
    if isinstance(value, (str, Path)):
        return Plan.from_json(value)
    if value is not None and not isinstance(value, Plan):
        raise TypeError(f"plan must be a fxopt.Plan, the path of its JSON, or None; got {type(value).__name__}")
    return value


def _time_limit(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {value!r}")
    return float(value)


def _effort(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"effort must be a positive number (a multiple of the default solver effort), got {value!r}")
    return float(value)


def _instance(name: str, cls: type, optional: bool = False) -> Callable[[Any], Any]:
    def check(value):
        if not isinstance(value, cls) and not (optional and value is None):
            raise TypeError(f"{name} must be a {cls.__name__}{' or None' if optional else ''}, got {value!r}")
        return value
    return check


def _offload(value: bool | int | str | None) -> bool | int | None:
    """None, True, False, or the host memory limit in bytes."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, (int, str)):
        raise TypeError(f"offload must be None, True, False or a host memory limit (bytes or '16GiB'), got {value!r}")
    try:
        limit = Budget.parse(value)
    except BudgetError as err:
        raise BudgetError(f"offload={value!r}: pass True, False, None or a host memory limit (bytes or a size "
                          f"such as '16GiB'); {err}") from None
    if limit.bytes is None:
        raise BudgetError(f"offload={value!r}: a host memory limit is bytes or a size string ('16GiB'), not a "
                          "fraction or 'min'; or pass True, False or None")
    return limit.bytes


def _device(value: str | Path | DeviceProfile | None) -> DeviceProfile | None:
    return None if value is None else load_device(value)


def _offload_text(text: str) -> bool | str:
    return {"on": True, "off": False}.get(text.strip().lower(), text)


def _budget_text(text: str) -> Budget:
    """A budget typed on the command line: ``0.5`` is a share, as the float 0.5 is."""
    number = text.strip()
    value: int | float | str = number
    if number.isdigit():
        value = int(number)
    elif number.replace(".", "", 1).isdigit() and "." in number:
        value = float(number)
    return Budget.parse(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """How to plan a training step. Every entry point (`fxopt.optimize`, `fxopt.plan`,
    `fxopt.backend` and ``options={...}``, `fxopt.pipeline`, `fxopt.max_batch`, the command line)
    takes these, as an `Options` or as keyword arguments; see each field. Made once per call, checked
    when made."""

    budget: Budget = option(check=Budget.parse, flag=Flag(parse=_budget_text, default="50%", metavar="BUDGET"), doc="""
        The peak the step may reach: bytes, a size ("3GiB"), a share of the eager peak (0.5 or
        "50%") or "min", the smallest budget fxopt can meet. A size is an int of bytes or a
        string: KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000. A share is of the un-rewritten
        step's peak (with compiler="inductor", of Inductor's own step's measured peak), a float
        in (0, 1] or a percentage. The peak counts all tensor memory live
        during forward and backward: parameters, buffers, inputs, gradients, activations,
        temporaries.""")
    solver: str = option("auto", check=_solver, flag=Flag(choices=SOLVERS, help=(
        "which solver plans the step: auto (the cheapest plan of the heuristics, the instant program and the ILP), "
        "one of those alone, or save_all (no rewrite) (default auto)")), doc="""
        Which solver plans the step. One of `fxopt.solvers.SOLVERS`: "auto" runs the fast
        heuristics and the instant program, then, unless its plan is proven near optimal, the
        other heuristics and the ILP, and keeps the cheapest plan; "ilp", "instant", "segments",
        "greedy", "checkpoint" (Chen's segments) each run alone; "save_all" rewrites nothing.""")
    plan: Plan | None = option(None, check=_plan, doc="""
        Replay this plan instead of solving: a `fxopt.Plan`, or the path of its JSON. It must have
        been made for the same graph.""")
    time_limit: float = option(DEFAULT_TIME_LIMIT, check=_time_limit, flag=Flag(parse=float, metavar="SECONDS"), doc="""
        A safety stop: seconds one answer (a plan, or "infeasible") may take, capture included, in
        CPU time of the planning thread (a loaded machine does not reach it sooner). The solvers'
        counted work (``effort``) decides the plan; a plan the limit cuts short says so (a
        `SolverTimeoutWarning`) and is not cached.""")
    effort: float = option(1.0, check=_effort, flag=Flag(parse=float, metavar="X"), doc="""
        How much counted work the solvers may do (branch-and-bound nodes, rounds, tries), as a
        multiple of the default (`fxopt.solvers.Effort`): the same effort gives the same plan on
        a quiet machine and a busy one; more may find a cheaper plan on a large step.""")
    mip_solver: str | None = option(None, check=_mip_solver, flag=Flag(choices=MIP_SOLVERS), doc="""
        The program that solves the ILP and the instant program: "highs" (HiGHS through highspy)
        or "cbc" (CBC through PuLP: slower, and without progress or bounds while it runs). None:
        HiGHS where highspy is installed, else CBC (`fxopt.solvers.mip.default_mip_solver`).""")
    cost_model: CostModel = option(factory=CostModel, check=_instance("cost_model", CostModel), doc="""
        How ops are priced: the estimated seconds the solvers minimise
        (`fxopt.analysis.CostModel`).""")
    compiler: str = option("eager", check=_compiler, flag=Flag(choices=COMPILERS), doc="""
        What runs the rewritten forward and backward: "eager" (FX code, op by op) or "inductor"
        (a fractional budget is then a share of Inductor's own step's measured peak). See
        `fxopt.capture.inductor`.""")
    inductor_config: dict | None = option(None, check=_instance("inductor_config", dict, optional=True), doc="""
        Extra Inductor settings, with compiler="inductor".""")
    compress: bool = option(True, check=_instance("compress", bool), flag=Flag(
        negate=True, help="recompute only: no lossless compression of saved values"), doc="""
        Let the solver COMPRESS saved values losslessly: bool masks as packed bits, ReLU's
        backward reading a bool mask, max-pooling indices as int32. Gradients stay
        bit-identical.""")
    quantize: Quantize | None = option(None, check=resolve_quantize, flag=Flag(choices=QUANTIZE_FORMATS), doc="""
        Also let the solver quantize saved floating-point activations (lossy: gradients change).
        A `fxopt.Quantize`, or its format's name; None: off.""")
    offload: bool | int | None = option(None, check=_offload, flag=Flag(
        parse=_offload_text, metavar="on|off|SIZE", help="let the solver keep saved values in host memory: on, off, "
        "or on within SIZE of host memory ('16GiB') (default: on for a model on a CUDA device)"), doc="""
        Let the solver OFFLOAD saved values to host memory. None: on where the step runs on a CUDA
        device; True or False to force it; or the most host memory it may hold at once (bytes, or a
        size such as "16GiB"): on, within that.""")
    reorder: bool = option(False, check=_instance("reorder", bool), flag=Flag(
        choices=("on", "off"), parse=lambda text: text == "on", help="on: also plan the step with its ops in a "
        "memory-aware order, and keep the better plan (default off)"), doc="""
        Also plan the step with its ops in a memory-aware order (`fxopt.solvers.order`: the same
        values, computed in another order within the graph's dependencies; random ops,
        mutations and collectives keep theirs), and keep the better of the two plans (lower
        cost, then lower peak; the captured order on a tie): a lower smallest budget, never a
        worse plan. Planning takes up to about twice as long. Off: the captured order.""")
    loss_in_place: bool = option(True, check=_instance("loss_in_place", bool), flag=Flag(
        choices=("on", "off"), parse=lambda text: text == "on", help="on: the cross-entropy's backward writes its "
        "result over its incoming gradient, two logits-sized tensors at a time, not three (bit-equal; default on)"), doc="""
        Plan and run the step with the cross-entropy's backward written into its incoming
        gradient's buffer (`fxopt.passes.loss`: eager's own kernel, ``out=`` that buffer), so it
        holds two logits-sized tensors at a time, not three: a lower peak where the loss's
        backward is the peak (a language model's head). Bit-equal to eager: the same kernel on the
        same inputs. With ``compiler="inductor"`` it is not applied (Inductor graphs are
        functional). Off: the backward as captured.""")
    device: DeviceProfile | None = option(None, check=_device, flag=Flag(metavar="PROFILE"), doc="""
        Plan for this device without running the step: a shipped profile's name (`fxopt.devices.names`:
        "cpu", "H100-80GB", "A100-40GB", "H200") or the path of a profile's JSON. The step is captured
        on fake tensors (FakeTensorMode), so a model built under torch.device("meta") is planned too.
        None: plan on the model's own tensors, measuring on its device.""")
    stamp: bool = option(True, check=_instance("stamp", bool), flag=Flag(
        choices=("on", "off"), parse=lambda text: text == "on", help="on: a run of 8 or more identical blocks is "
        "captured as 3 and 4 blocks and stamped out (plans ahead of a run only; default on)"), doc="""
        Where fxopt plans a step without running it (`fxopt.plan`, `fxopt.fit`, ``fxopt inspect``)
        and the model holds a run of 8 or more identical blocks (a transformer's layers), capture
        the step with the run cut to 3 blocks and to 4, and make the graph of all of them from
        those two (`fxopt.capture.repeat`): the same graph, node for node, in a fraction of the
        capture's time; checked on the 4-block capture, and captured whole where the check fails.
        Off: capture every block.""")

    planned_for: DeviceProfile | None = option(None, internal=True, doc="""
        The profile the analysis counts memory and prices ops for: set by ``device`` once the
        step is captured on fake tensors of the host (`fxopt.plan_ahead`).""")
    in_flight: InFlight | None = option(None, internal=True, doc="""
        The step is one microbatch of a pipeline stage, whose device also holds what this says;
        the budget is the device's (`fxopt.solvers.stages.solve_stage`).""")
    alternatives: tuple[Plan, ...] = option((), check=tuple, internal=True, doc="""
        Plans to replay beside ``plan``, each on the graph it was made for (a pipeline stage's
        steps that start with earlier microbatches' gradients held).""")
    plan_from_examples: bool = option(False, internal=True, doc="""
        ``plan`` was made here from example inputs: a graph it does not fit (another input shape,
        autocast on) is planned anew instead of refused.""")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check = field.metadata["check"]
            if check is not None:
                object.__setattr__(self, field.name, check(getattr(self, field.name)))

    @classmethod
    def of(cls, budget: BudgetLike | Options, /, defaults: dict[str, Any] | None = None, **fields) -> Options:
        """The options a call gives: ``budget`` may itself be an `Options` (then ``fields`` replace
        some of it); ``defaults``: the entry point's own defaults where they differ from the
        fields' (for fields not given). An unknown name is refused, naming the options."""
        check_names(fields)
        if isinstance(budget, Options):
            return dataclasses.replace(budget, **fields) if fields else budget
        return cls(budget=budget, **{**(defaults or {}), **fields})

    def solver_key(self) -> str:
        """The solver as the plan cache keys a plan: with the MIP program where one is chosen,
        whether the ops may be reordered, and for a pipeline stage what its device holds beside."""
        key = self.solver if self.mip_solver is None else f"{self.solver}|{self.mip_solver}"
        key = f"{key}|reorder" if self.reorder else key
        return key if self.in_flight is None else f"{key}|{self.in_flight.key()}"

    @property
    def host_budget(self) -> int | None:
        """The host memory OFFLOAD may hold at once, when ``offload`` gives one (else None)."""
        return None if self.offload is None or isinstance(self.offload, bool) else self.offload


def public_fields() -> Iterator[dataclasses.Field]:
    """The fields users set, in order (not those fxopt's entry points set themselves)."""
    return (f for f in dataclasses.fields(Options) if not f.metadata["internal"])


def check_names(given, besides: tuple[str, ...] = ()) -> None:
    """Refuse a name in ``given`` that is no option (nor one of ``besides``, an entry point's own
    arguments), naming the options."""
    names = [f.name for f in public_fields()] + list(besides)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"unknown fxopt option(s) {', '.join(map(repr, unknown))}; the options are "
                         f"{', '.join(names)} (see fxopt.Options)")
