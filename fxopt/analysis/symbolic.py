"""Sizes as expressions: one analysis of a step captured with dynamic shapes, for every shape.

With dynamic shapes (``torch._dynamo.mark_dynamic``) every size in the captured joint graph is a
``SymInt`` whose ``node.expr`` is a sympy expression in Dynamo's shape symbols (``s95``, ``s75``).
fxopt renames those to the user's names (``batch``, ``seq``: `fxopt.capture.shapes`), keeps each
value's bytes, compressed bytes and FLOPs as expressions, and evaluates them at any shape into a
plain `fxopt.solvers.Graph`, so the solvers and the simulator stay as they are:

    logits:  bytes = 2048*batch*seq        at {batch: 8, seq: 128}: 2,097,152
    attn:    bytes = 64*batch*seq**2       at {batch: 8, seq: 128}: 8,388,608

Why one plan holds for a whole range. The simulator's memory after each step is a sum of the
sizes of the storages alive then, plus the running op's scratch memory; which storages are
alive depends only on the schedule and the graph's structure, never on a size (OFFLOAD, whose
copies take time, is the exception: it is not offered with dynamic shapes). So when every size
is non-decreasing in every symbol, each step's memory is too, and so is their maximum, the
peak: a schedule that fits at the largest shape of a range fits at every shape in it. The same
holds for `fxopt.solvers.instant.peak_lower_bound` (sums and maxima of the same sizes) and the
eager peak. `check_monotone` verifies the premise for every size (it is not assumed: a size
that shrinks as a symbol grows is an error naming the value). Scratch memory is measured by
running each op at one concrete shape (`fxopt.analysis.scratch`): it is measured at the largest
shape of the range the plan is for and counted as that constant at every smaller shape, which
is conservative as long as a kernel does not allocate more for a smaller input.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import sympy
import torch
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from fxopt.analysis.costs import CostModel
from fxopt.devices import rounded_up
from fxopt.errors import CaptureError
from fxopt.solvers.graph import Graph
from fxopt.solvers.prefetch import priced

Point = Mapping[str, int]  # a shape: a value for each named symbol
Size = int | sympy.Expr  # a size: a number, or an expression in named symbols


class NewGuardError(RuntimeError):
    """A guard attempted on a step's sizes while fxopt reads them (torch before 2.13, whose
    ``ShapeEnv`` has no ``error_on_new_guards``; `error_on_new_guards`)."""


@contextlib.contextmanager
def error_on_new_guards(shape_env) -> Iterator[None]:
    """While inside, a guard attempted on ``shape_env`` raises: nothing fxopt decides may narrow
    the shapes the compiled step accepts. torch 2.13's ``ShapeEnv.error_on_new_guards``; before
    it (torch 2.11, 2.12), the same done here: the env frozen (a frozen env drops a guard with a
    log line) and its frozen check raising instead."""
    if hasattr(shape_env, "error_on_new_guards"):
        with shape_env.error_on_new_guards():
            yield
        return

    def refuse(expr, concrete_val):
        raise NewGuardError(f"Guard attempted while ShapeEnv guards are frozen: {expr} == {concrete_val}")

    old_frozen, old_check = shape_env.frozen, shape_env.__dict__.get("_check_frozen")
    shape_env.frozen = True
    shape_env._check_frozen = refuse  # (an instance attribute: the class's method stays)
    try:
        yield
    finally:
        shape_env.frozen = old_frozen
        if old_check is None:
            del shape_env._check_frozen
        else:  # (nested: the outer one's)
            shape_env._check_frozen = old_check


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol fxopt gives a named dimension (non-negative integers, as sizes are)."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


@dataclasses.dataclass(frozen=True)
class Ranges:
    """The range of each named symbol, inclusive: ``{"batch": (1, 32), "seq": (2, 512)}``."""

    bounds: Mapping[str, tuple[int, int]]

    def __post_init__(self):
        for name, (lo, hi) in self.bounds.items():
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
                raise ValueError(f"the range of {name!r} must be two integers 0 <= lo <= hi, got {(lo, hi)!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.bounds)

    def top(self) -> dict[str, int]:
        """The largest shape: every symbol at the top of its range."""
        return {name: hi for name, (_, hi) in self.bounds.items()}

    def bottom(self) -> dict[str, int]:
        return {name: lo for name, (lo, _) in self.bounds.items()}

    def contains(self, point: Point) -> bool:
        return all(lo <= point[name] <= hi for name, (lo, hi) in self.bounds.items())

    def with_bound(self, name: str, lo: int, hi: int) -> Ranges:
        return Ranges({**self.bounds, name: (lo, hi)})

    def value_ranges(self) -> dict[sympy.Symbol, ValueRanges]:
        return {symbol(name): ValueRanges(lo, hi) for name, (lo, hi) in self.bounds.items()}


def _subs(point: Point) -> dict[sympy.Symbol, sympy.Integer]:
    return {symbol(name): sympy.Integer(v) for name, v in point.items()}


class Evaluator:
    """Sizes at one shape; each distinct expression evaluated once (a graph has few)."""

    def __init__(self, point: Point):
        self.point = dict(point)
        self._subs = _subs(point)
        self._done: dict[sympy.Expr, int] = {}

    def __call__(self, size: Size) -> int:
        if isinstance(size, int):
            return size
        value = self._done.get(size)
        if value is None:
            done = size.xreplace(self._subs)
            if not done.is_number:
                missing = ", ".join(sorted(str(s) for s in done.free_symbols))
                raise CaptureError(f"the size {size} needs a value for {missing}: give it a range in dynamic=")
            value = self._done[size] = int(done)
        return value


class Sizes:
    """How the analysis reads a captured graph's sizes: `expr` turns an int or a ``SymInt`` into a
    `Size` in the user's symbols (``names``: Dynamo's symbol -> the user's), `at` evaluates one at
    the shape the graph is analysed for (``point``). Without names the graph must be static."""

    def __init__(self, names: Mapping[sympy.Symbol, sympy.Symbol] | None = None, point: Point | None = None,
                 ranges: Ranges | None = None):
        self.names = dict(names or {})
        self.ranges = ranges
        self.point = dict(point or {})
        self.at_point = Evaluator(self.point)
        self._renamed: dict[sympy.Expr, Size] = {}

    @property
    def symbolic(self) -> bool:
        return bool(self.names)

    def expr(self, x) -> Size:
        if isinstance(x, torch.SymInt):
            e = x.node.expr
            if e.is_number:
                return int(e)
            if not self.names:
                raise CaptureError(
                    f"a size of the captured step is symbolic ({e}); fxopt plans a static step unless "
                    "dynamic= names the dimensions that vary (see docs/dynamic-shapes.md)")
            renamed = self._renamed.get(e)
            if renamed is None:
                unknown = e.free_symbols - self.names.keys()
                if unknown:
                    raise CaptureError(unnamed_symbols_message(x, unknown))
                renamed = sympy.expand(e.xreplace(self.names))
                if self.ranges is not None:
                    renamed = simplify_on(renamed, self.ranges)
                self._renamed[e] = renamed
            return renamed
        if isinstance(x, sympy.Expr):
            return int(x) if x.is_number else x
        return int(x)

    def at(self, x) -> int:
        return self.at_point(self.expr(x))


def unnamed_symbols_message(x: torch.SymInt, unknown) -> str:
    shape_env = x.node.shape_env
    where = []
    for s in sorted(unknown, key=str):
        sources = shape_env.var_to_sources.get(s, [])
        where.append(f"{s} ({sources[0].name if sources else 'made inside the model'})")
    return ("the captured step has a size symbol with no range in dynamic=: " + ", ".join(where)
            + ". Name that dimension in dynamic= with its range, or keep it static")


def largest(x) -> int:
    """The value of a size at the top of its symbols' ranges as Dynamo knows them (the ranges
    fxopt marked the inputs with): what fxopt's size thresholds (a tensor worth compressing)
    read, so that a step's structure is the same at every shape. Never a guard."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    e = x.node.expr
    if e.is_number:
        return int(e)
    ranges = x.node.shape_env.var_to_range
    top = {s: ranges[s].upper for s in e.free_symbols}
    value = e.xreplace(top)
    if not value.is_number or not value.is_finite:
        raise CaptureError(f"the size {e} has no upper bound: give every dynamic dimension a range")
    return int(value)


def simplify_on(size: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    """``size`` with each maximum or minimum whose winner is the same over the whole of ``ranges``
    replaced by it (Dynamo writes ``Max(1, seq)`` where ``seq`` may be 0 or 1): what is left reads
    as the sizes it stands for, and its monotonicity can be told."""
    from torch.utils._sympy.functions import Max, Min

    vr = ranges.value_ranges()

    def dominant(args, pick_max: bool):
        for a in args:
            if all(b is a or bound_sympy(a - b if pick_max else b - a, vr).lower >= 0 for b in args):
                return a
        return None

    def visit(e):
        if not e.args:
            return e
        e = e.func(*(visit(a) for a in e.args))
        if isinstance(e, (Max, sympy.Max, Min, sympy.Min)) and e.free_symbols <= set(vr):
            winner = dominant(e.args, isinstance(e, (Max, sympy.Max)))
            if winner is not None:
                return winner
        return e

    return sympy.expand(visit(size))


@dataclasses.dataclass(frozen=True)
class Monotonicity:
    """Whether a `Size` is non-decreasing in every symbol over a range, and why not."""

    ok: bool
    why: str = ""


def monotone(size: Size, ranges: Ranges) -> Monotonicity:
    """Check (not assume) that ``size`` never decreases as any symbol grows within ``ranges``:
    a polynomial by the sign of its partial derivatives over the box (`bound_sympy`), anything
    else by its structure (sums, products of non-negative factors, floor and ceiling divisions
    by positive constants, maxima and minima of such)."""
    if isinstance(size, int) or size.is_number:
        return Monotonicity(True)
    size = simplify_on(size, ranges)
    vr = ranges.value_ranges()
    symbols = sorted(size.free_symbols, key=str)
    if all(s in vr for s in symbols) and size.is_polynomial(*symbols):
        for s in symbols:
            slope = bound_sympy(sympy.diff(size, s), vr)
            if not slope.lower >= 0:
                return Monotonicity(False, f"it decreases as {s} grows (slope {sympy.diff(size, s)})")
        return Monotonicity(True)
    return _structurally_monotone(size, vr)


def _structurally_monotone(e: sympy.Expr, vr: dict) -> Monotonicity:
    from torch.utils._sympy.functions import CeilToInt, CleanDiv, FloorDiv, FloorToInt, Max, Min

    if e.is_number or e.is_Symbol:
        return Monotonicity(e.is_number or e in vr, "" if e in vr or e.is_number else f"{e} has no range")
    if isinstance(e, (sympy.Add, Max, Min, sympy.Max, sympy.Min, CeilToInt, FloorToInt)):
        parts = e.args
    elif isinstance(e, sympy.Mul):
        negative = [a for a in e.args if not bound_sympy(a, vr).lower >= 0]
        if negative:
            return Monotonicity(False, f"its factor {negative[0]} may be negative")
        parts = e.args
    elif isinstance(e, (FloorDiv, CleanDiv, sympy.floor, sympy.ceiling)) or type(e).__name__ == "CeilDiv":
        divisor = e.args[1] if len(e.args) > 1 else sympy.Integer(1)
        if not (divisor.is_number and divisor > 0):
            return Monotonicity(False, f"it divides by {divisor}, not a positive constant")
        parts = e.args[:1]
    elif isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
        if not bound_sympy(e.base, vr).lower >= 0:
            return Monotonicity(False, f"its base {e.base} may be negative")
        parts = (e.base,)
    else:
        return Monotonicity(False, f"fxopt cannot tell how {type(e).__name__} ({e}) varies")
    for part in parts:
        if not (check := _structurally_monotone(part, vr)).ok:
            return check
    return Monotonicity(True)


@dataclasses.dataclass(frozen=True)
class NodeSizes:
    """The sizes of one value as expressions: its bytes, the bytes its op reads and writes, its
    FLOPs, and, with a codec, its compressed bytes and the codec's FLOPs."""

    bytes: Size = 0
    moved: Size = 0
    flops: Size = 0
    compressed_bytes: Size = 0
    codec_flops: Size = 0
    comm: Size = 0  # bytes a collective receives (an all-gather's), priced apart from FLOPs


@dataclasses.dataclass(frozen=True, eq=False)
class SymbolicGraph:
    """A solver graph whose sizes are expressions (``sizes[i]`` for ``graph.nodes[i]``; ``graph``
    is the graph at ``point``): `at` gives the plain `Graph` at any shape, its scratch memory
    (``workspace``, measured per op at one shape) and measured storage bytes given or kept."""

    graph: Graph
    sizes: tuple[NodeSizes, ...]
    ranges: Ranges
    point: Mapping[str, int]
    cost_model: CostModel
    names: Mapping[sympy.Symbol, sympy.Symbol] = dataclasses.field(default_factory=dict)  # see `Sizes`
    # Per value, the bytes of its storage as the real kernel allocated it at ``point`` where that
    # is more than its size says (`fxopt.analysis.scratch.OpMemory`), else 0: a floor under
    # ``bytes``, measured like the scratch memory (and kept, like it, where `at` is given none).
    measured_bytes: tuple[int, ...] = ()
    # The device allocator's block size (`fxopt.devices.DeviceProfile.round_bytes`): each storage,
    # and each encoding of one, is held rounded up to a multiple of it (1: as it is).
    round_bytes: int = 1

    def at(self, point: Point, workspace: Sequence[int] | None = None,
           codec_workspace: Sequence[int] | None = None, measured_bytes: Sequence[int] | None = None) -> Graph:
        size = Evaluator(point)
        cost = self.cost_model.seconds
        floor = self.measured_bytes if measured_bytes is None else measured_bytes
        nodes = []
        for k, (node, s) in enumerate(zip(self.graph.nodes, self.sizes)):
            nbytes, flops, comm = size(s.bytes), size(s.flops), size(s.comm)
            if k < len(floor) and node.storage is None:
                nbytes = max(nbytes, floor[k])
            compressed, codec_flops = size(s.compressed_bytes), size(s.codec_flops)
            if self.round_bytes > 1:
                nbytes, compressed = rounded_up(nbytes, self.round_bytes), rounded_up(compressed, self.round_bytes)
            # (A re-gather's communication: ``comm_exposed``, all of it until `priced` says how much is hidden.
            # A collective of the backward, waited where issued: its whole communication in ``cost``,
            # and ``comm_seconds`` the time it holds the process group, where a re-gather may queue.)
            regathers = self._regathers(node)
            held = self.cost_model.comm_seconds(comm) if regathers or self._waits_in_backward(node, comm) else 0.0
            exposed = held if regathers else 0.0
            nodes.append(node.replaced(
                bytes=nbytes, flops=flops, comm_bytes=comm,
                cost=0.0 if node.kind == "input" else exposed + cost(
                    flops, size(s.moved), node.storage is not None, 0 if exposed else comm,
                    node.op_class == "pointwise"),
                compressed_bytes=compressed, codec_flops=codec_flops,
                codec_cost=2 * cost(codec_flops // 2, nbytes + compressed, False) if node.codec else 0.0,
                workspace=node.workspace if workspace is None else workspace[k],
                codec_workspace=node.codec_workspace if codec_workspace is None else codec_workspace[k],
                comm_seconds=held, comm_exposed=exposed))
        return priced(Graph(tuple(nodes), self.graph.transfers))

    def _regathers(self, node) -> bool:
        """Whether ``node`` is an all-gather the backward may run again, issued ahead of its wait
        (`fxopt.solvers.prefetch`; `CostModel.overlap_regathers`)."""
        return self.cost_model.overlap_regathers and node.kind == "forward" and node.recomputable

    def _waits_in_backward(self, node, comm) -> bool:
        """Whether ``node`` is a collective of the backward (a gradient's reduce-scatter or
        all-reduce) on the process group that re-gathers share (`fxopt.solvers.prefetch`)."""
        return self.cost_model.overlap_regathers and node.kind == "backward" and bool(comm)

    def check_monotone(self, ranges: Ranges | None = None) -> None:
        """Raise `CaptureError` naming the first value a size of which is not non-decreasing in
        every symbol over ``ranges`` (by default the graph's): the premise of one plan for a range."""
        ranges = ranges or self.ranges
        checked: dict[sympy.Expr, Monotonicity] = {}
        for node, s in zip(self.graph.nodes, self.sizes):
            for field in ("bytes", "compressed_bytes"):
                size = getattr(s, field)
                if isinstance(size, int):
                    continue
                if size not in checked:
                    checked[size] = monotone(size, ranges)
                if not checked[size].ok:
                    raise CaptureError(
                        f"{node.name}'s {field.replace('_', ' ')} {size} is not non-decreasing in "
                        f"{', '.join(ranges.names)} ({checked[size].why}): one plan cannot be proven "
                        "for the whole range; narrow the range or plan each shape (dynamic=None)")
