"""A step that Dynamo captures in pieces, planned piece by piece so the whole step stays bounded.

Where Dynamo cannot trace a model's forward whole (``.item()`` steering Python control flow, an
unsupported library call), it compiles the forward in pieces with Python in between. Each piece
is an autograd function of its own: its forward runs, then the next piece's; the backward runs
the pieces' backwards in reverse order. So while piece k runs (forward or backward), the step
also holds:

  - every resident tensor that piece k does not take as an input: the parameters and buffers of
    the other pieces, the user's inputs it does not read;
  - what earlier pieces left alive after their forward: their SAVEd values (as their plans keep
    them) and the outputs they returned, unless piece k takes them as inputs;
  - in its backward, the gradients of parameters that later pieces have already produced;
  - what holds memory through the step beside the model's tensors: DDP's gradient buckets
    (`fxopt.distributed.data_parallel`).

fxopt plans piece k within ``budget − reserve_k``, the sum of the above but the later pieces'
gradients, which exist only once the backward has reached piece k: those are held through piece
k's backward alone, as its plan counts its incoming gradients (`fxopt.analysis.analyze`'s
``backward_held_bytes``). So the peak of every piece, counted with everything else alive, is
within the budget:

    budget 100 MiB:  piece 0 [embeddings]  reserve 40 (other pieces' weights; their grads, in its backward)
                     piece 1 [blocks]      reserve 55 (piece 0's weights and what it saved...)

The reserve is a bound, not an estimate: an earlier piece's outputs count as alive until the step
ends unless their storage has been freed by the time the piece starts (a hidden state one piece
returns and the next reads without saving), and a tied parameter (registered under several names, as tied embeddings are), whose
gradient a later piece may accumulate before this piece's backward adds its own, has that
gradient counted twice. What fxopt cannot see: tensors that the Python between pieces allocates
and keeps (ops run eagerly there), and a parameter shared across pieces without being registered
twice (one module called on both sides of a break). Budgets
are bytes, or "min" (each piece at its own smallest budget: the step then holds at most what
`fxopt.FxoptModule.peak_bound_bytes` says); a fraction of the step's eager peak is not known until
every piece has run.

What an earlier piece keeps for its backward is part of every later piece's reserve, and it is
planned before they are seen: planned to keep all that fits, it may leave a later piece no room.
So a byte budget is planned across the pieces (`PiecewiseBackend`): the first call plans every
piece at its smallest budget (within the budget, or refused), and once the call has shown every
piece, each is planned again to keep no more than leaves every later piece the room it needed:

    budget 100:  first call   piece 0 keeps 10, needs 60   piece 1 (beside 30 + 10) needs 50
                 next calls   piece 0 keeps at most 100 - 50 - 30 = 20   piece 1 planned within 100 - 30 - 20
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.budget import Budget
from fxopt.capture import coverage
from fxopt.capture.dynamo import unreached_gradients_stay_undefined
from fxopt.errors import BudgetError, CaptureError, InfeasibleBudgetError
from fxopt.solvers.graph import Graph
from fxopt.solvers.liveness import LiveBytes
from fxopt.solvers.plan import Plan
from fxopt.storage import StorageKey, local, module_tensors, storage_key, storage_refs, storages, tensors_in
from fxopt.units import format_bytes

log = logging.getLogger("fxopt")

# A piece's plan, by what it was made for: the budget given to the piece (bytes; None: its own
# smallest) and the bytes held beside its backward only (`Reserve.backward_bytes`).
VariantKey = tuple[int | None, int]

# Planning a run of a piece again once the step is known (`PiecewiseBackend._within_room`): at most
# this many budgets tried between the plan it ran with and the largest the rest of the step leaves
# it, and none closer than this share of the budget to one tried already (counted work, not time).
SEARCH_STEPS = 4
SEARCH_RESOLUTION = 64

# What `fxopt.optimize` does with a step Dynamo captures in pieces: plan the pieces in order
# within the budget, or refuse.
GRAPH_BREAKS = ("split", "error")


class GraphBreakWarning(UserWarning):
    """Dynamo captured the step in pieces (see `fxopt.capture.pieces` and `fxopt.backend`'s ``graph_breaks``)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece whose forward ran in the current step."""

    plan: Plan | None  # None: no backward (nothing kept for one; its outputs still count)
    inputs: frozenset[StorageKey]  # storages of the real tensors it takes
    saved_bytes: int  # what its forward keeps for its backward (as the plan keeps it)
    outputs: dict[StorageKey, int]  # storage -> bytes of the tensors its forward returned in this step
    refs: dict[StorageKey, Any] = dataclasses.field(default_factory=dict)  # weak references to them
    made: tuple[int, int] = (0, 0)  # the autograd node numbers its call made, from and to (`fxopt.capture.coverage`)
    whole: bool = False  # planned as the whole step
    graph: int = -1  # which graph ran (`PiecewiseBackend`'s numbering)
    key: VariantKey | None = None  # the plan it ran with (`Variant`)
    reserve: Reserve | None = None  # what the rest of the step held beside it
    at_floor: bool = False  # planned at its smallest budget, the step not known yet (`PiecewiseBackend`)
    example: tuple | None = None  # then: its inputs, as fake tensors (`fake_copies`)

    def outputs_alive(self) -> dict[StorageKey, int]:
        """Its outputs whose storage is still alive (one freed since never comes back)."""
        return {k: n for k, n in self.outputs.items() if k not in self.refs or not self.refs[k].expired()}


class Wrapping(Protocol):
    """What a step's distributed wrapping tells the pieces (`fxopt.distributed.data_parallel.DistributedStep`)."""

    in_pieces: bool  # no graph is the whole step (FSDP2: its hooks run between graphs)
    glue_nodes: tuple[str, ...]  # autograd nodes of identity functions it wraps around the step
    eager_advice: str  # what to do about an operation that ran eagerly between pieces

    def blocks_to_come(self) -> list[set[StorageKey]] | None:
        """The blocks still to run their forward, each as the storages of its parameters (FSDP2's
        units, sharded), or None where not known."""

    def is_own_break(self, where: str) -> bool:
        """Whether a graph break at ``where`` is the wrapping's own (no warning for those)."""


@dataclasses.dataclass(frozen=True)
class Reserve:
    """What the rest of the step holds while a piece runs: ``bytes`` through its forward and its
    backward, and ``backward_bytes`` more through its backward only (the gradients later pieces'
    backwards made first)."""

    bytes: int
    backward_bytes: int = 0

    def __str__(self) -> str:
        more = f" (and {format_bytes(self.backward_bytes)} more in its backward)" if self.backward_bytes else ""
        return f"{format_bytes(self.bytes)}{more}"


@dataclasses.dataclass
class Step:
    """One call of the optimized module: what is resident, and the pieces that ran so far.

    What is resident (``resident``, ``trainable``, ``shared``) is what the reserves of pieces count,
    and a step captured whole has no reserve: it is read from the model's tensors when a piece
    first needs it, not at every call (on a bench ViT, reading it took about 0.13 ms of a 21 ms
    step, timed alone: issue 28). Where every graph is a piece (FSDP2, whose hooks
    swap the model's parameters between pieces) it is read as the call starts."""

    tensors: tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]  # the parameters, buffers, and the call's arguments
    model: nn.Module | None = None
    # Alive beside every piece, seen by no tensor of the model (DDP's buckets, FSDP2's buffers): bytes,
    # or the function that counts them, called where a plan first needs them (`held`), not at every call.
    held_of: int | Callable[[], int] = 0
    wrapping: Wrapping | None = None
    since: int = 0  # autograd's node count when the call started (`fxopt.capture.coverage`)
    pieces: list[Piece] = dataclasses.field(default_factory=list)
    at_floors: bool | None = None  # every piece of this call planned at its smallest budget (`PiecewiseBackend`)

    @classmethod
    def start(cls, model: nn.Module, args: Iterable[Any], held: int | Callable[[], int] = 0,
              wrapping: Wrapping | None = None,
              tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> Step:
        """``tensors``: the model's parameters and buffers, each under each of its names
        (`fxopt.storage.module_tensors` with ``remove_duplicate=False``), where the caller walked
        the model already in this call (this runs at every call)."""
        params, buffers = tensors if tensors is not None else module_tensors(model, remove_duplicate=False)
        step = cls((params, buffers, list(args)), model, held, wrapping, torch.autograd._get_sequence_nr())
        if wrapping is not None and wrapping.in_pieces:  # (`every_graph_a_piece`, read as it reads it)
            step._trainable_and_shared  # (read now: see the class docstring)
        return step

    @functools.cached_property
    def held(self) -> int:
        """Bytes alive beside every piece that no tensor of the model shows (see ``held_of``)."""
        return self.held_of() if callable(self.held_of) else self.held_of

    @functools.cached_property
    def resident(self) -> dict[StorageKey, int]:
        """Storage -> bytes: the parameters, buffers and inputs, and the gradients there."""
        params, buffers, args = self.tensors
        return storages([params, buffers, *args], grads=True)

    @property
    def trainable(self) -> dict[StorageKey, int]:
        """Storage of a parameter that requires grad -> bytes of its gradient."""
        return self._trainable_and_shared[0]

    @property
    def shared(self) -> frozenset[StorageKey]:
        """The trainable parameters registered under several names (tied weights)."""
        return self._trainable_and_shared[1]

    @functools.cached_property
    def _trainable_and_shared(self) -> tuple[dict[StorageKey, int], frozenset[StorageKey]]:
        self.resident  # (read together)
        trainable: dict[StorageKey, int] = {}
        names: dict[StorageKey, int] = {}
        for p in self.tensors[0]:
            shard = local(p)
            key = storage_key(shard)
            names[key] = names.get(key, 0) + 1
            if p.requires_grad:
                trainable[key] = shard.numel() * p.element_size()
        return trainable, frozenset(ptr for ptr, n in names.items() if n > 1)

    @property
    def resident_read(self) -> bool:
        """Whether what is resident has been read in this call (see the class docstring)."""
        return "resident" in self.__dict__

    @property
    def every_graph_a_piece(self) -> bool:
        return self.wrapping is not None and self.wrapping.in_pieces

    def check_covered(self, outputs: Any) -> None:
        """Refuse the call if its graphs did not cover the step (`fxopt.capture.coverage`): no graph
        where the outputs need a backward, a graph planned as the whole step beside others, or
        computation outside the graphs that the plans do not bound."""
        if not torch.is_grad_enabled():
            return
        # Where every autograd node this call made was made inside the graphs that ran (autograd
        # numbers each node it makes), no walk can find one outside them: the usual call of a step
        # captured whole, which then walks nothing (issue 28).
        inside, planned = 0, False
        for p in self.pieces:
            inside += p.made[1] - p.made[0]
            planned = planned or p.plan is not None
        if planned and inside == torch.autograd._get_sequence_nr() - self.since and (
                len(self.pieces) == 1 or not any(p.whole for p in self.pieces)):
            return
        if not any(t.requires_grad for t in tensors_in(outputs)):
            return
        if not any(p.plan is not None for p in self.pieces):
            raise CaptureError(
                "torch.compile captured no graph of this training step that has a backward, so it would run "
                f"unoptimized. {coverage.SKIP_ADVICE}")
        planned = coverage.made_in(p.made for p in self.pieces)
        glue = coverage.HOOK_NODES + (self.wrapping.glue_nodes if self.wrapping is not None else ())
        if any(p.whole for p in self.pieces):
            if len(self.pieces) > 1:
                raise CaptureError(
                    f"fxopt planned one graph of this call as the whole training step, but {len(self.pieces)} "
                    f"graphs ran in it, and the plan does not count the others. {coverage.SKIP_ADVICE}")
            coverage.check_whole(outputs, self.since, planned, glue)
        else:
            advice = (self.wrapping.eager_advice if self.wrapping is not None else "") or coverage.SKIP_ADVICE
            coverage.check_pieces(outputs, self.since, planned, self.counted(), glue, advice)

    def counted(self) -> set[StorageKey]:
        """The storages every reserve from now on counts: resident, held by the model now, or
        returned by a piece so far."""
        out = set(self.resident) | set(storages(self.model) if self.model is not None else {})
        for p in self.pieces:
            out |= set(p.outputs)
        return out

    def reserve(self, inputs: frozenset[StorageKey]) -> Reserve:
        """Bytes alive beside a piece taking ``inputs``, at any time while it runs (and those alive
        through its backward only): each storage counted once (`fxopt.solvers.liveness.LiveBytes`,
        the solvers' own live-bytes count), those the piece takes left to its own plan."""
        alive = LiveBytes(Graph(()), base=self.held)
        parts = []

        def hold(name: str, sizes, into: LiveBytes = alive) -> None:
            before = into.bytes
            for key, n in sizes:
                into.hold(key, n)
            parts.append(f"{into.bytes - before} {name}")

        hold("other resident", ((("storage", k), n) for k, n in self.resident.items() if k not in inputs))
        # Parameters the model holds now and did not at the start: FSDP2's unsharded parameters of
        # the blocks gathered so far that are not resharded yet (the root's; a block's without
        # reshard_after_forward), which stay so through this piece's backward too.
        now = storages(self.model) if self.model is not None else {}
        hold("gathered parameters", ((("storage", k), n) for k, n in now.items() if k not in inputs))
        # What earlier pieces saved, and the outputs they returned that this piece does not take
        # (those it takes, it counts itself).
        hold("from earlier pieces", [(("saved", i), p.saved_bytes) for i, p in enumerate(self.pieces)] + [
            (("storage", k), n) for p in self.pieces for k, n in p.outputs_alive().items() if k not in inputs])
        # Gradients later pieces' backwards produce: none exists before the backward reaches this
        # piece, so they are held beside its backward only.
        later, grads = self._grads_to_come(inputs), LiveBytes(Graph(()))
        hold("later gradients (backward only)", ((("gradient", k), n) for k, n in self.trainable.items() if k in later),
             grads)
        log.debug("fxopt: reserve beside a piece: %s, %d held", ", ".join(parts), self.held)
        return Reserve(alive.bytes, grads.bytes)

    def _grads_to_come(self, inputs: frozenset[StorageKey]) -> set[StorageKey]:
        """The trainable parameters whose gradients later pieces' backwards produce before the
        backward of the piece taking ``inputs`` runs: those no piece so far takes, and this piece's
        tied parameters, which a later piece may also use and accumulate into first. Blocks that
        take their parameters gathered (FSDP2) are known by their shards instead: those of the
        blocks to come."""
        blocks = self.wrapping.blocks_to_come() if self.wrapping is not None else None
        if blocks is not None:
            return set().union(*blocks)
        seen = inputs.union(*(p.inputs for p in self.pieces))
        return {k for k in self.trainable if k not in seen or (k in inputs and k in self.shared)}


def break_location(gm: fx.GraphModule) -> str | None:
    """``file:line (reason)`` of the graph break that ends this piece, or None if none does."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    where = "an unknown place"
    if reason.user_stack:
        frame = reason.user_stack[-1]
        where = f"{frame.filename}:{frame.lineno}"
    why = reason.reason.strip().splitlines()[0] if reason.reason else "unknown reason"
    if "logging" in why.lower() or "logger" in why.lower():
        why += ("; a logging call inside forward(): fxopt.optimize skips those, or add the method to "
                "torch._dynamo.config.ignore_logger_methods")
    return f"{where} ({why})"


def compiling_code() -> types.CodeType | None:
    """The code object of the frame Dynamo is compiling (called from inside a backend), or None
    where this torch does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # noqa: BLE001 - not inside a compile, or another torch's internals
        return None


_TORCH_DIR = str(Path(torch.__file__).parent)


def nested_frame(entries: frozenset[types.CodeType]) -> str | None:
    """Where Dynamo compiles a frame other than the step's own (``entries``: the code objects fxopt
    enters the step through), as ``function (file:line)``: it could not resume the step's frame
    after a graph break deeper down (inside a ``with`` block or a module hook, under a decorator),
    ran that frame eagerly and compiles the functions it calls, each on its own. Such a graph is a
    piece of the step, not the whole of it. None for the step's own frame, a frame of torch's, or
    where this torch does not say."""
    code = compiling_code()
    if code is None or not entries or code in entries or code.co_filename.startswith(_TORCH_DIR):
        return None
    return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A piece's graph compiled with one plan (None: no backward)."""

    compiled: Callable
    plan: Plan | None
    saved_bytes: int  # what its forward keeps for its backward, as the plan keeps it

    @property
    def peak_bytes(self) -> int:
        return self.plan.peak_bytes if self.plan is not None else 0


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a piece in a call the backend learned the step from (`Learned.learn`):
    which graph ran, what the rest of the step held beside it but what the earlier runs saved
    (their plans decide that), the plan it ran with, within the budget, and its inputs as fake
    tensors (their shapes, strides, dtypes and aliasing, no data) to plan it again with."""

    graph: int
    backward_bytes: int
    beside: int
    key: VariantKey
    saved_bytes: int
    peak_bytes: int
    inputs: tuple = ()

    @property
    def step(self) -> tuple[int, int]:
        return self.graph, self.backward_bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    """The plan a run of a piece runs with, and what it was chosen beside."""

    graph: int
    key: VariantKey
    variant: Variant
    reserve: Reserve
    at_floor: bool = False


class Learned:
    """The calls a step in pieces was learned from (`PiecewiseBackend`), each as its runs in order
    (`Run`), and the room each run leaves the ones before it."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.paths: list[tuple[Run, ...]] = []
        self.unprepared: list[tuple[Run, ...]] = []  # learned, their runs not planned again yet

    def learn(self, step: Step) -> None:
        """Learn the path of a call that planned some of its pieces at their smallest budget, once
        it has run."""
        for p in step.pieces:  # (a loop: this runs at every call, a step whole included)
            if p.at_floor:
                break
        else:
            return
        if any(p.reserve is None or p.example is None for p in step.pieces):
            return
        runs, kept = [], 0
        for p in step.pieces:
            runs.append(Run(p.graph, p.reserve.backward_bytes, p.reserve.bytes - kept, p.key, p.saved_bytes,
                            p.plan.peak_bytes if p.plan is not None else 0, p.example))
            kept += p.saved_bytes
        self.paths.append(tuple(runs))
        self.unprepared.append(tuple(runs))

    def through(self, runs: list[tuple[int, int]]) -> list[tuple[Run, ...]]:
        """The paths learned that start with ``runs`` (each as (graph, backward bytes))."""
        return [path for path in self.paths if len(path) >= len(runs) and [r.step for r in path[:len(runs)]] == runs]

    def room(self, path: tuple[Run, ...], kept: list[int]) -> float:
        """The most run ``len(kept)`` of ``path`` may keep for its backward so that every later run
        still fits with the plan it ran with: the budget, less what that run needed beside the
        rest, what the rest held beside it but the earlier runs' saved values, and what the other
        earlier runs keep (``kept``, then the later ones' as they ran)."""
        room, between = float("inf"), 0
        for run in path[len(kept) + 1:]:
            room = min(room, self.budget - run.peak_bytes - run.beside - sum(kept) - between)
            between += run.saved_bytes
        return room


def refusal(choice: Choice, budget: int, learned: bool) -> InfeasibleBudgetError:
    """The error for a run whose plan, beside what the rest of the step holds, is over ``budget``:
    planned at its smallest budget before the step was known, or in a call that ran differently
    from those ``learned`` from."""
    reserve = choice.reserve
    beside = f"The step is captured in pieces, and the rest of the step holds {reserve} while this piece runs."
    if learned:
        why = ("This call ran differently from the calls fxopt learned the step from (another path through "
               "the Python between the pieces, or more held beside them), so the pieces before this one kept "
               "what fitted beside the pieces those calls ran. The next call plans every piece at its own "
               "smallest budget again, and learns this path too.")
    else:
        why = ("fxopt plans every piece at its own smallest budget until it has seen the whole step, and at "
               "that this piece needs this much beside the ones before it, so no plan of the step within the "
               "budget is known; later pieces may need more. budget='min' plans every piece at its own "
               "smallest budget; the module's peak_bound_bytes then says what the step holds.")
    return InfeasibleBudgetError(budget, reserve.bytes + choice.variant.peak_bytes, f"{beside} {why}", exact=False)


class RunPlans:
    """The plans the runs of a step's pieces run with (`PiecewiseBackend`; the module docstring
    says how a byte budget is planned across the pieces): the first call (and one that runs pieces
    in an order not seen yet) plans every piece at its smallest budget, within the budget or
    refused (`_check_fits`); once it has run, its path is learned (`Learned`); before the next call,
    each run is planned again (`prepare`, `_within_room`), from the learning call's inputs as fake
    tensors, not while a piece runs: compiled mid-step, inside the frame Dynamo runs for the model,
    the new plans made a later full collection crash the interpreter on corrupted memory, 1 test
    run in 3 (the cause is not found; graphs that run several times a step are still compiled
    mid-step for their later runs, and transformers' Longformer, split several times a layer,
    crashes so at `1f2eb34` too, in the CPU profiler's destructor). A run whose reserve differs
    from the learned one takes the plan it ran with. FSDP2's pieces are planned in
    order (their plans are agreed between ranks, one per piece, not chosen by each rank); ``"min"``
    plans every piece at its smallest budget on every call. ``make_piece_backend``, ``on_plan``: as
    for `PiecewiseBackend`."""

    def __init__(self, budget: Budget, make_piece_backend: Callable, on_plan: Callable[[Plan], None]):
        self.budget = budget
        self.make_piece_backend = make_piece_backend
        self.on_plan = on_plan
        self.graphs: list[fx.GraphModule] = []  # each piece's graph
        self.variants: list[dict[VariantKey, Variant]] = []  # each piece's graph: its plans so far
        self.learned = Learned(budget.bytes)
        self.floors_next = False  # the next call plans every piece at its smallest budget (and is learned)
        self.bounds: dict[tuple, int] = {}  # per plan and reserve met: the most the step holds while it runs
        self._given: set[tuple[int, VariantKey]] = set()  # plans given to on_plan
        self._infeasible: set[tuple[int, VariantKey]] = set()  # plans tried that found no schedule

    def add(self, gm: fx.GraphModule) -> int:
        """A piece's graph, by its number."""
        self.graphs.append(gm)
        self.variants.append({})
        return len(self.graphs) - 1

    def whole(self, gm: fx.GraphModule, example_inputs) -> Choice:
        """The plan of a graph that is the whole step."""
        graph, key = self.add(gm), (self.budget.bytes, 0)
        self.variants[graph][key] = self._compile(gm, example_inputs, self.budget, Reserve(0), whole=True)
        return self._chosen(Choice(graph, key, self.variants[graph][key], Reserve(0)))

    def choose(self, step: Step | None, graph: int, args, inputs: frozenset[StorageKey]) -> Choice:
        """The plan this run of ``graph`` in ``step`` runs with, beside what the rest of the step
        holds now (see the class docstring)."""
        variants = self.variants[graph]
        if step is None:  # run outside a call of the module: no reserve to plan for, the first plan made
            key = next(iter(variants))
            return Choice(graph, key, variants[key], Reserve(0))
        if step.at_floors is None:  # (the call's first piece)
            step.at_floors, self.floors_next = self.floors_next, False
        reserve = step.reserve(inputs)
        if self.budget.bytes is None:  # "min": every piece at its own smallest budget
            return self._chosen(self._at(graph, args, (None, reserve.backward_bytes), reserve))
        if step.every_graph_a_piece:  # FSDP2: in order, each within what the rest leaves it
            key = (self.budget.bytes - reserve.bytes, reserve.backward_bytes)
            return self._chosen(self._at(graph, args, key, reserve))
        done = [(p.graph, p.reserve.backward_bytes if p.reserve is not None else 0) for p in step.pieces]
        paths = [] if step.at_floors else self.learned.through([*done, (graph, reserve.backward_bytes)])
        if not paths:
            floor = self._at(graph, args, (None, reserve.backward_bytes), reserve)
            floor = dataclasses.replace(floor, at_floor=True)
            self._check_fits(floor, learned=False)
            return self._chosen(floor)
        # (planned before the call, `prepare`: a plan not made then is not made now)
        choice = self._within_room(graph, None, reserve, paths, [p.saved_bytes for p in step.pieces])
        self._check_fits(choice, learned=True)
        return self._chosen(choice)

    def prepare(self) -> None:
        """Before a call: plan again the runs of the paths learned since the last (see the class
        docstring), each beside the reserve its learning call met, less what the earlier runs saved
        there, plus what they keep now."""
        planned = False
        while self.learned.unprepared:
            path = self.learned.unprepared.pop(0)
            kept: list[int] = []
            for r, run in enumerate(path):
                reserve = Reserve(run.beside + sum(kept), run.backward_bytes)
                paths = self.learned.through([x.step for x in path[:r + 1]])
                choice = self._within_room(run.graph, run.inputs, reserve, paths, kept)
                kept.append(choice.variant.saved_bytes)
                planned = True
        if planned:
            # Planning leaves reference cycles through its frames (an error a solver raised and
            # another caught, with its traceback); collected now, before the step runs.
            gc.collect()

    def _within_room(self, graph: int, example_inputs, reserve: Reserve, paths: list[tuple[Run, ...]],
                     kept: list[int]) -> Choice:
        """The plan of run ``len(kept)`` of ``paths`` (``kept``: what the runs before it keep), beside
        ``reserve``, that keeps at most the room the later runs leave it (`Learned.room`): the plan within
        what the rest of the step leaves it, if it keeps that little; else the plan at the largest
        budget found that does, by bisection (`SEARCH_STEPS` plans at most) between the plan it ran
        with when the step was learned, which does, and that budget. Plans are made only with
        ``example_inputs`` (`prepare`); without, only those made already are taken."""
        variants, backward_bytes = self.variants[graph], reserve.backward_bytes
        room = min(self.learned.room(path, kept) for path in paths)

        def planned_at(budget: int) -> Choice | None:
            key = (budget, backward_bytes)
            if (graph, key) in self._infeasible or (example_inputs is None and key not in variants):
                return None
            try:
                return self._at(graph, example_inputs, key, reserve)
            except InfeasibleBudgetError:
                self._infeasible.add((graph, key))
                return None

        high = self.budget.bytes - reserve.bytes
        largest = planned_at(high)
        if largest is not None and largest.variant.saved_bytes <= room:
            return largest
        ran = {path[len(kept)].key for path in paths}
        key = min(ran, key=lambda k: (variants[k].saved_bytes, k[0] is None, k[0] or 0))
        best = self._at(graph, None, key, reserve)
        low = best.variant.peak_bytes
        for _ in range(SEARCH_STEPS):
            if high - low <= self.budget.bytes // SEARCH_RESOLUTION:
                break
            middle = (low + high) // 2
            choice = planned_at(middle)
            if choice is not None and choice.variant.saved_bytes <= room:
                best, low = choice, middle
            else:
                high = middle
        return best

    def _check_fits(self, choice: Choice, learned: bool) -> None:
        """Refuse a run whose plan, beside what the rest of the step holds, is over the budget (the
        next call then plans every piece at its smallest budget, and is learned from)."""
        if choice.reserve.bytes + choice.variant.peak_bytes > self.budget.bytes:
            self.floors_next = True
            raise refusal(choice, self.budget.bytes, learned)

    def _at(self, graph: int, example_inputs, key: VariantKey, reserve: Reserve) -> Choice:
        """The run of ``graph`` with the plan ``key`` names, compiled now if it was not yet (on
        ``example_inputs``)."""
        variants = self.variants[graph]
        if key not in variants:
            budget = Budget(minimum=True) if key[0] is None else key[0]
            log.info("fxopt: planning a piece of the step %s (the rest of the step holds %s)",
                     "at its smallest budget" if key[0] is None else f"within {format_bytes(key[0])}", reserve)
            # (Dynamo compiles a graph once, inside its compile: the first plan then. Another (a run
            # beside another reserve, FSDP2's blocks; at another floor; `prepare`) is compiled
            # outside Dynamo's compile.)
            compile_now = self._compile if not variants else torch._dynamo.disable(self._compile)
            variants[key] = compile_now(self.graphs[graph], example_inputs, budget, reserve)
        return Choice(graph, key, variants[key], reserve)

    def _chosen(self, choice: Choice) -> Choice:
        """``choice``, its plan given to ``on_plan`` once, and the most the step holds while it runs."""
        plan = choice.variant.plan
        if plan is not None:
            if (choice.graph, choice.key) not in self._given:
                self._given.add((choice.graph, choice.key))
                self.on_plan(plan)
            self.bounds[choice.graph, choice.key, choice.reserve] = choice.reserve.bytes + plan.peak_bytes
        return choice

    def _compile(self, gm, example_inputs, budget, reserve: Reserve, *, whole: bool = False) -> Variant:
        """The graph compiled with its plan for ``budget`` (bytes, or a `Budget`)."""
        beside = f"The step is captured in pieces, and the rest of the step holds {reserve} while this piece runs."
        if reserve.bytes and isinstance(budget, int) and budget <= 0:
            raise InfeasibleBudgetError(budget + reserve.bytes, reserve.bytes + 1, beside, exact=False)
        plans: list[Plan] = []
        try:
            compiled = self.make_piece_backend(budget, plans.append, whole, reserve.backward_bytes)(gm, example_inputs)
        except InfeasibleBudgetError as err:
            if whole or not isinstance(budget, int):
                raise
            # In pieces planned in order (FSDP2's), what a piece needs is a bound for the step, never
            # its smallest feasible budget: at it, a later piece may need more. (Its own minimum
            # counts what the rest holds beside its backward only.)
            bound = InfeasibleBudgetError(budget + reserve.bytes, err.min_budget + reserve.bytes, err.detail,
                                          exact=False)
            raise bound.with_detail(
                f"{beside} The pieces before it were planned first, keeping what fitted beside them; at a larger "
                "budget they may keep more, so the budget named is what this piece needs beside them as planned "
                "now, not a promise for the step.") from None
        plan = plans[-1] if plans else None
        return Variant(compiled, plan, plan.timeline().saved_bytes if plan is not None else 0)




class PiecewiseBackend:
    """The backend of an `fxopt.FxoptModule` whose step may be captured in pieces: it plans each
    piece against the budget minus what the rest of the step holds (see the module docstring; the
    plans of its runs: `RunPlans`). ``make_piece_backend(budget, on_plan, whole, backward_bytes)``
    builds the planning backend of one piece (``whole``: the piece is the whole step;
    ``backward_bytes``: held beside its backward only, `Reserve.backward_bytes`); ``on_plan`` is
    given each plan a run of the step runs with; ``unreached_gradients_undefined``: the pieces'
    outputs the loss does not reach get no zero-filled gradient (the eager compiler:
    `fxopt.capture.dynamo.unreached_gradients_stay_undefined`)."""

    def __init__(self, budget: Budget,
                 make_piece_backend: Callable[[Any, Callable[[Plan], None], bool, int], Callable],
                 graph_breaks: str, on_plan: Callable[[Plan], None] | None = None,
                 unreached_gradients_undefined: bool = False):
        self.budget = budget
        self.graph_breaks = graph_breaks
        self.runs = RunPlans(budget, make_piece_backend, on_plan or (lambda plan: None))
        self.unreached_gradients_undefined = unreached_gradients_undefined
        self.step: Step | None = None
        self.warned: set[str] = set()
        self.entries: frozenset[types.CodeType] = frozenset()  # the code objects the step is entered through

    @property
    def bounds(self) -> list[int]:
        """Per plan run, beside each reserve it met: the most the step holds while it runs."""
        return list(self.runs.bounds.values())

    def prepare(self) -> None:
        """Before a call: the runs of the calls learned from planned again (`RunPlans.prepare`)."""
        self.runs.prepare()

    def learn(self, step: Step) -> None:
        """After a call: its path learned where it planned pieces at their smallest budget (`Learned`)."""
        self.runs.learned.learn(step)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        where = break_location(gm)
        if where is None and (nested := nested_frame(self.entries)) is not None:
            where = f"a graph break inside {nested}, which Dynamo compiled on its own"
        in_pieces = where is not None or bool(self.step and (self.step.pieces or self.step.every_graph_a_piece))
        if not in_pieces:  # the whole step in one graph
            choice = self.runs.whole(gm, example_inputs)
            return self._recorded(lambda args, inputs: choice, whole=True)
        if self.graph_breaks == "error":
            raise CaptureError(
                f"torch.compile split this training step at a graph break at {where or 'an earlier piece'}; "
                "with graph_breaks='error' fxopt refuses a step it does not see whole. Remove the break "
                "(data-dependent Python such as .item() is the usual cause), or use graph_breaks='split' "
                "(the default) to plan the pieces within the budget."
            )
        if self.budget.bytes is None and not self.budget.minimum:
            raise BudgetError(
                f"this training step is captured in pieces (a graph break at {where or 'an earlier piece'}), "
                f"so fxopt plans it piece by piece and needs the budget in bytes, not {str(self.budget)!r}: the "
                "step's eager peak is not known until every piece has run. Pass bytes, a size such as '2GiB', or "
                "'min' (each piece planned at its own smallest budget) "
                "(for a share of the eager peak, measure one eager step: peak = fxopt.measure_peak(step, model, "
                "batch).peak_bytes, then budget=int(0.5 * peak))."
            )
        # FSDP2's hooks split its step by design (fxopt.distributed.data_parallel): no warning for those.
        own = where is not None and self.step is not None and self.step.wrapping is not None \
            and self.step.wrapping.is_own_break(where)
        if where is not None and where not in self.warned and not own:
            self.warned.add(where)
            message = (f"torch.compile split this training step at a graph break at {where}; fxopt plans "
                       "the pieces so that each fits within what the budget leaves beside the others")
            log.warning("fxopt: %s", message)
            warnings.warn(message, GraphBreakWarning, stacklevel=2)
        if self.step is None:
            raise CaptureError("fxopt: a piece of the step was compiled outside an fxopt module's call")
        return self._piece(gm, example_inputs)

    def _piece(self, gm: fx.GraphModule, example_inputs):
        """A piece: Dynamo compiles a graph once, and it may run several times in one step (one
        FSDP2 block's forward serves every block, a frame split inside a loop every iteration),
        each time beside a different rest of the step, and in later calls with more room than in
        the first. Each run gets its plan (`RunPlans.choose`): the first now, inside Dynamo's compile."""
        graph = self.runs.add(gm)

        def variant(args, inputs: frozenset[StorageKey]) -> Choice:
            return self.runs.choose(self.step, graph, args, inputs)

        variant(example_inputs, frozenset(storages(list(example_inputs))))
        return self._recorded(variant)

    def _recorded(self, variant: Callable[[Any, frozenset[StorageKey]], Choice], whole: bool = False):
        """Run the compiled graph of the plan ``variant(args, inputs)`` chooses, and record it in the
        step, with the autograd nodes its call made (and, where planned at its smallest budget
        before the step was known, its inputs as fake tensors, to plan it again with)."""
        def run(*args):
            # (A graph planned as the whole step has no reserve, and takes every parameter: its inputs
            # and outputs are not read at each call. Another graph beside it in a call is refused,
            # `check_covered`; until then its reserve counts every gradient as one to come, the
            # larger count. Autograd's node count is read as `coverage.sequence_number` does.)
            inputs = frozenset() if whole else frozenset(storages(list(args)))
            choice = variant(args, inputs)
            example = fake_copies(args) if choice.at_floor else None
            since = torch.autograd._get_sequence_nr()
            outputs = choice.variant.compiled(*args)
            if self.unreached_gradients_undefined and not whole:
                unreached_gradients_stay_undefined(outputs)
            if self.step is not None:
                made = (since, torch.autograd._get_sequence_nr())
                held = ({}, {}) if whole else (storages(outputs), storage_refs(outputs))
                self.step.pieces.append(Piece(choice.variant.plan, inputs, choice.variant.saved_bytes, *held, made,
                                              whole, choice.graph, choice.key, choice.reserve, choice.at_floor,
                                              example))
            return outputs

        return run


def fake_copies(args) -> tuple:
    """``args`` with each tensor as a fake tensor of one fake mode (shapes, strides, dtypes,
    ``requires_grad`` and the storages they share, no data): a piece's example inputs to plan it
    again with once it has run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
