"""Data parallel steps through fxopt: what DDP adds to each rank's peak, and how fxopt's one-graph
step runs under it.

DDP (``torch.nn.parallel.DistributedDataParallel``) in either order:

    DDP(fxopt.optimize(model, budget))      fxopt.optimize(DDP(model), budget)

Both run DDP's own forward (its pre- and post-forward work: buffer broadcast, the reducer's
bookkeeping) eagerly, and the wrapped module's step as one fxopt graph. In the second order fxopt
compiles ``ddp.module`` and routes DDP's call of it to the compiled step (`routed`), as
``nn.Module.compile`` would. Dynamo's DDP optimizer, which would split the graph at bucket
boundaries so that each bucket's all-reduce overlaps the rest of the backward, is off while fxopt
compiles (``torch._dynamo.config.optimize_ddp=False``): fxopt plans the whole step.

In the second order the gradients' all-reduces are inside fxopt's graph (`fxopt.distributed.ddp`):
DDP's forward runs under its own ``no_sync()`` (its reducer's hooks do nothing), and each
parameter is read through an identity whose backward all-reduces its gradient, averaged over the
ranks, as functional collectives the plan counts and prices, coalesced into DDP's buckets
(`fxopt.passes.coalesce`); each bucket's is issued in the backward as its last gradient is
complete. Otherwise (the first order, a step that starts with gradients held, the user's own
``no_sync()``, a DDP that has run under ``Join``, and the settings
`fxopt.distributed.ddp.not_one_graph` names, with a warning) gradients are reduced by DDP's own
reducer: its hooks on the parameters' gradient
accumulators fire as autograd accumulates each gradient the compiled backward returns, so those
all-reduces start only after the whole backward has run (they overlap only the accumulation of
later gradients): the all-reduce time eager DDP would have hidden behind the backward.

What DDP adds to the peak: its gradient buckets, one flat tensor per bucket, together as large as
the gradients of the parameters it reduces, allocated when the DDP is built and alive through
every step (also with ``gradient_as_bucket_view=True``, where the gradients are views of the
buckets between steps, while the backward's fresh gradients are still allocated and copied in).
fxopt counts them (`held_bytes`: those the gradients are not views of, which the step's resident
tensors show already) as resident memory the step does not read; a step captured in pieces counts
them in every piece's reserve (`fxopt.capture.pieces`).

FSDP2 (``fully_shard`` per block): its step is one graph, fxopt gathering the shards itself with
FSDP2's hooks off (`fxopt.distributed.fsdp2`, `DistributedStep.one_graph`), unless a setting needs
those hooks (`fxopt.distributed.fsdp2.not_one_graph`); then, with the functions below
(`fsdp_units` onwards; docs/multi-device.md), every graph of its step is a piece of
`fxopt.capture.pieces`, planned beside the reserve that counts FSDP's shards, gathered parameters
and buffers.

Refused, with the reason: a DDP built for compiled autograd (``optimize_ddp="python_reducer"``),
communication hooks (``register_comm_hook``: they allocate what fxopt cannot see), DDP's
``mixed_precision`` and delayed all-reduce parameters (buffers fxopt does not count).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fxopt.distributed import ddp as ddp_graph, fsdp, fsdp2
from fxopt.errors import BudgetError, CaptureError
from fxopt.storage import local, storage_bytes, storage_key


def _ddp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def is_ddp(module: Any) -> bool:
    cls = _ddp_class()
    return cls is not None and isinstance(module, cls)


def running_ddp(module: nn.Module, cls: type | None = None) -> nn.Module | None:
    """The DDP whose forward is calling ``module`` now (``DDP(fxopt.optimize(model))``), or None
    (``cls``: DDP's class, where the caller looked it up already: this runs at every call)."""
    cls = cls or _ddp_class()
    if cls is None:
        return None
    ddp = cls._get_active_ddp_module()
    return ddp if ddp is not None and ddp.module is module else None


def check_ddp(ddp: nn.Module) -> None:
    """Refuse what fxopt cannot bound or run under DDP (see the module docstring)."""
    fix = "; use DDP's defaults there, or run fxopt without DDP"
    if getattr(ddp, "_use_python_reducer", False):
        raise CaptureError(
            "this DDP was built with torch._dynamo.config.optimize_ddp='python_reducer', whose reducer "
            "all-reduces only under compiled autograd, which fxopt does not use: build the DDP with "
            "the default optimize_ddp setting")
    if getattr(ddp, "_comm_hooks", None):
        raise CaptureError(
            "this DDP has a communication hook (register_comm_hook): it allocates buffers of its own "
            f"while gradients are reduced, which fxopt cannot count in the budget{fix}")
    if getattr(ddp, "mixed_precision", None) is not None:
        raise CaptureError(
            "this DDP casts parameters for mixed_precision=, copies fxopt does not count in the budget"
            f"{fix} (torch.autocast inside the model is supported)")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise CaptureError(
            "this DDP delays the all-reduce of some parameters (delay_all_reduce_named_params=), into a "
            f"buffer fxopt does not count in the budget{fix}")


def bucket_bytes(ddp: nn.Module) -> int:
    """Bytes of DDP's gradient buckets, as its reducer reports them (alive through every step)."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
    if sizes is None:
        raise CaptureError("this DDP does not report its gradient buckets' sizes, so fxopt cannot count "
                           "them in the budget")
    return sum(int(s) for s in str(sizes).replace(",", " ").split())


def held_bytes(objs: Any) -> int:
    """Bytes that the DDPs among ``objs`` (a DDP, or an fxopt module of one) hold and no reachable
    tensor shows: their gradient buckets, less those the parameters' gradients are views of
    (``gradient_as_bucket_view=True``), which a walk of the model's tensors already finds."""
    found = {}
    for o in objs if isinstance(objs, (list, tuple)) else [objs]:
        for candidate in (o, getattr(o, "__dict__", {}).get("_model")):
            if is_ddp(candidate):
                found[id(candidate)] = candidate
    total = 0
    for ddp in found.values():
        seen = {}
        if ddp.gradient_as_bucket_view:
            for p in ddp.module.parameters():
                if p.grad is not None and storage_key(p.grad) is not None:
                    seen[storage_key(p.grad)] = storage_bytes(p.grad)
        total += max(0, bucket_bytes(ddp) - sum(seen.values()))
    return total


def module_call(module: nn.Module):
    """A function that calls ``module`` as ``module(...)`` does (hooks, then forward), for
    torch.compile to capture. It enters at ``_call_impl``, past the check for a compiled call that
    `routed` installs, so that tracing it does not meet the compiled call itself."""
    def call(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    return call


@contextlib.contextmanager
def routed(module: nn.Module, compiled_call):
    """While inside, calling ``module`` runs ``compiled_call`` instead (what ``nn.Module.compile``
    installs for good): DDP's forward, calling its wrapped module, runs fxopt's step."""
    previous = module._compiled_call_impl
    module._compiled_call_impl = compiled_call
    try:
        yield
    finally:
        module._compiled_call_impl = previous


# ------------------------------------------------------------------------------------------ FSDP2


def _fsdp_module_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made FSDP2 units, in module order."""
    cls = _fsdp_module_class()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def _managed(unit: nn.Module, units: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters FSDP2 shards for ``unit``: its own, not those of units inside it."""
    inner = {id(p) for u in units if u is not unit and any(u is m for m in unit.modules()) for p in u.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner]


def unsharded_bytes(unit: nn.Module, units: list[nn.Module]) -> int:
    """Bytes of ``unit``'s parameters gathered whole, as FSDP2 all-gathers them (each padded to
    a multiple of the world size along the dimension it shards)."""
    total = 0
    for p in _managed(unit, units):
        world = p.device_mesh.size() if hasattr(p, "device_mesh") else 1
        rows = math.ceil(p.shape[0] / world) * world if p.dim() else 1
        total += rows * (p.numel() // max(1, p.shape[0] if p.dim() else 1)) * p.element_size()
    return total


def check_fsdp(units: list[nn.Module], graph_breaks: str) -> None:
    """Refuse FSDP2 settings whose memory fxopt does not count (`fxopt.distributed.fsdp2.check`),
    or does not count in pieces (`fxopt.distributed.fsdp2.check_pieces`: mixed precision), and
    pieces where they are refused (for a step FSDP2's own hooks must run)."""
    fsdp2.check(units)
    fsdp2.check_pieces(units)
    if graph_breaks == "error":
        raise CaptureError(
            "this FSDP2 model's step is captured in pieces (FSDP's hooks run between them, outside any graph: "
            f"{fsdp2.not_one_graph(units)}), and graph_breaks='error' refuses pieces: use graph_breaks='split' "
            "(the default), or change that setting to plan the step as one graph")


def fsdp_held_bytes(units: list[nn.Module]) -> int:
    """A bound on what FSDP2 holds beside a piece of the step, or between two pieces, that no
    parameter shows when the piece is planned (U: a unit's parameters gathered whole; blocks: the
    units inside the outermost):

      - in the forward, the all-gather output of the unit that runs, kept for the next unit's
        copy-in (U), with the next one's beside it in that unit's pre-forward hook, and those of
        the units ``set_modules_to_forward_prefetch`` names (U each);
      - in the backward, the all-gather output of the block it prefetches (one by default, or as
        many as ``set_modules_to_backward_prefetch`` names), the reduce-scatter input it keeps
        until the next reduce-scatter, and, in a block's post-backward hook, the one being filled
        with a shard beside it (a reduce-scatter output);
      - the gradients of the outermost units' parameters, whole: such a unit's forward takes no
        input that requires grad (token ids), so FSDP reduce-scatters them only when the whole
        backward is done, and they accumulate beside every later piece's backward.

    The largest block (or unit) stands for every block (a bound, not an estimate)."""
    outermost = [u for u in units if not any(v is not u and any(u is m for m in v.modules()) for v in units)]
    blocks = [u for u in units if not any(u is v for v in outermost)]
    largest_unit = max((unsharded_bytes(u, units) for u in units), default=0)
    largest = max((unsharded_bytes(u, units) for u in blocks), default=0)
    forward = max((len(u._get_fsdp_state()._states_to_forward_prefetch) for u in units), default=0)
    backward = max((len(u._get_fsdp_state()._states_to_backward_prefetch) for u in units), default=0)
    world = max((p.device_mesh.size() for u in units for p in _managed(u, units) if hasattr(p, "device_mesh")),
                default=1)
    in_forward = (2 + forward) * largest_unit
    in_backward = (max(1, backward) + 2) * largest + math.ceil(largest / world)
    root_grads = sum(unsharded_bytes(u, units) for u in outermost if any(p.requires_grad for p in _managed(u, units)))
    return max(in_forward, in_backward) + root_grads


def units_to_come(units: list[nn.Module]) -> list[set]:
    """The FSDP2 units that have not started their forward yet in this step (each will keep
    activations for its backward beside what runs now, and its sharded gradients will exist
    during the backward of what runs now), each as the storages of its sharded parameters."""
    out = []
    for unit in units:
        state = unit._get_fsdp_state()
        groups = fsdp2.param_groups(state)
        if not groups or state._training_state.name == "FORWARD":
            continue
        if not any(g is group for group in groups for g in group.comm_ctx.post_forward_order):
            out.append({storage_key(local(p)) for p in _managed(unit, units)})
    return out


def eager_modules(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The largest submodules of ``model`` that hold no FSDP2 unit, below those that do. A
    forward that calls FSDP2 units in a loop is not compiled (Dynamo skips a frame with a graph
    break inside a loop, and FSDP's hooks are graph breaks), so the submodules it calls would run
    eagerly, outside any plan; fxopt compiles each of them (`routed`)."""
    holding = {id(m) for u in units for m in model.modules() if any(u is x for x in m.modules())}
    found, stack = [], [model]
    while stack:
        m = stack.pop()
        for child in m.children():
            (stack if id(child) in holding else found).append(child)
    return found


def routes(modules: list[nn.Module], calls: list[Callable]):
    """`routed` for each module and its compiled call, together."""
    stack = contextlib.ExitStack()
    for module, call in zip(modules, calls):
        stack.enter_context(routed(module, call))
    return stack


# Autograd nodes of the identity functions DDP and FSDP2 wrap around a step (DDP's output sink, FSDP's
# post-backward registration): they compute nothing and keep nothing for the backward.
GLUE_NODES: tuple[str, ...] = ("_DDPSinkBackward", "RegisterPostBackwardFunctionBackward")

FSDP_EAGER_ADVICE = (
    "It is code a module runs itself between FSDP units, in a forward that Dynamo skips (FSDP's hooks are "
    "graph breaks, and a graph break inside a loop skips the frame; fxopt compiles the submodules such a "
    "forward calls, not its own operations): move those operations into a submodule, or into the FSDP unit "
    "they feed.")


class DistributedStep:
    """What DDP or FSDP2 do to a step fxopt plans, in one place: what fxopt compiles, how a call
    reaches the compiled step, what they hold beside it, and where their hooks split it. For a
    model under neither, each answer is the plain step's (compile the model, call it, nothing
    held beside it)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.ddp_class = _ddp_class()
        self.ddp = model if is_ddp(model) else None
        self.units = fsdp_units(model)
        # An FSDP2 model: one graph, fxopt gathering the shards (`fxopt.distributed.fsdp2`), unless a
        # setting needs FSDP2's own hooks: then block by block, the submodules between units compiled too.
        self.one_graph = None
        self.piece_units: list[nn.Module] = []
        if self.units:
            fsdp2.check(self.units)
            why = fsdp2.not_one_graph(self.units)
            if why is None:
                self.one_graph = fsdp2.OneGraph(self.units)
            else:
                self.piece_units = self.units
                warnings.warn(f"fxopt plans this FSDP2 model's step in pieces, around FSDP2's hooks, not as one "
                              f"graph: {why}", stacklevel=3)
        self.eager_modules = eager_modules(model, self.piece_units) if self.piece_units else []
        # fxopt.optimize(DDP(model)): the gradients' all-reduces in the graph (`fxopt.distributed.ddp`),
        # unless a setting needs DDP's reducer.
        self.ddp_graph = None
        if self.ddp is not None:
            check_ddp(self.ddp)
            why = ddp_graph.not_one_graph(self.ddp)
            if why is None:
                self.ddp_graph = ddp_graph.OneGraph(self.ddp)
            else:
                warnings.warn(f"fxopt leaves this DDP's gradients to its reducer, which all-reduces them after "
                              f"fxopt's whole backward (no overlap): {why}", stacklevel=3)

    glue_nodes = GLUE_NODES

    @property
    def in_pieces(self) -> bool:
        """Whether no graph of the step is the whole step (FSDP2 run by its hooks: they run between graphs)."""
        return bool(self.piece_units)

    def check(self, graph_breaks: str, budget_in_bytes: bool, dynamic: bool) -> None:
        """Refuse what fxopt cannot bound under this wrapping, saying why."""
        if dynamic and (self.ddp is not None or self.units):
            raise ValueError("dynamic= plans a step captured as one graph for a range of shapes; a DDP or FSDP2 "
                             "model is planned one shape at a time: plan it without dynamic= (each shape on its own)")
        if self.ddp is not None:
            check_ddp(self.ddp)
        if self.piece_units:
            check_fsdp(self.piece_units, graph_breaks)
            if not budget_in_bytes:
                raise BudgetError(
                    "fxopt plans this FSDP2 step piece by piece (FSDP's hooks run between the pieces) and needs "
                    "the budget in bytes, not a fraction or 'min': the step's eager peak and its smallest budget "
                    "are not known until every piece has run. Pass bytes or a size such as '2GiB'.")

    def target(self) -> Callable:
        """What fxopt compiles: the model, or the call of the module a DDP wraps (DDP's own forward
        runs as it is; see `call`), or the call of the model where its own hooks cast for mixed
        precision (FSDP2's policy on the root unit, `fxopt.distributed.fully_shard`'s): Dynamo
        runs the hooks of the module it compiles outside the graph, and traces a call's."""
        if self.ddp is not None:
            return module_call(self.model.module)
        if self._casts_at_root():
            return module_call(self.model)
        return self.model

    def _casts_at_root(self) -> bool:
        if self.one_graph is not None:
            return self.one_graph.casts(self.model)
        return fsdp.casts_at(self.model)

    def compile_between(self, compile_call: Callable[[Callable], Callable]) -> list[Callable]:
        """The compiled calls of the submodules between FSDP2 units (`eager_modules`)."""
        return [compile_call(module_call(m)) for m in self.eager_modules]

    def running_ddp(self, fxopt_module: nn.Module) -> nn.Module | None:
        """The DDP this call runs under: the model itself, or one whose forward calls the fxopt
        module (``DDP(fxopt.optimize(model))``)."""
        ddp = self.ddp if self.ddp is not None else running_ddp(fxopt_module, self.ddp_class)
        if ddp is not None:
            check_ddp(ddp)
        return ddp

    def held_beside(self, ddp: nn.Module | None) -> int:
        """Bytes held beside the step by no tensor of the model: DDP's buckets (those the
        gradients are not views of), a bound on FSDP2's buffers."""
        beside = held_bytes([ddp]) if ddp is not None else 0
        return beside + (fsdp_held_bytes(self.piece_units) if self.piece_units else 0)

    def call(self, run: Callable, compiled: Callable, between: list[Callable], args: tuple, kwargs: dict) -> Any:
        """Run one call: ``run(callable, args, kwargs)`` of the compiled step, or of the DDP whose
        call of its module is routed to it; the submodules between FSDP2 units routed to theirs."""
        if self.one_graph is None and not self.eager_modules:  # (nothing of FSDP2's to route)
            return self._run(run, compiled, args, kwargs)
        with routes(self.eager_modules, between), \
                (self.one_graph.gathering() if self.one_graph is not None else contextlib.nullcontext()):
            return self._run(run, compiled, args, kwargs)

    def _run(self, run: Callable, compiled: Callable, args: tuple, kwargs: dict) -> Any:
        if self.ddp is None:
            return run(compiled, args, kwargs)  # (the plain step: no Python around the call)
        with routed(self.model.module, compiled), \
                (self.ddp_graph.reducing() if self.ddp_graph is not None else contextlib.nullcontext()):
            return run(self.model, args, kwargs)

    def blocks_to_come(self) -> list[set] | None:
        """The FSDP2 units still to run their forward (`units_to_come`), or None without FSDP2."""
        return units_to_come(self.piece_units) if self.piece_units else None

    @staticmethod
    def is_own_break(where: str) -> bool:
        """Whether a graph break at ``where`` (``file:line (reason)``) is one of FSDP2's hooks,
        which split its step by design."""
        return "torch/distributed/fsdp" in where.replace("\\", "/")

    @property
    def eager_advice(self) -> str:
        """What to do about an operation that ran eagerly between pieces and keeps what no plan counts."""
        return FSDP_EAGER_ADVICE if self.piece_units else ""
