"""Dynamic shapes at capture: which input dimension is which named symbol, the marks Dynamo
captures them with, and the check that the captured step keeps every one of them symbolic.

The user names the dimensions that vary and their ranges (``dynamic=``)::

    {"batch": (1, 32)}               dim 0 of every tensor argument
    {"seq": (2, 512)}                dim 1 of every tensor argument with at least two dims
    {("pixel_values", 2): (32, 64)}  one dimension of one argument, by position or by name

Each input dimension named is marked dynamic (``torch._dynamo.mark_dynamic``, with its range),
Dynamo gives it a symbol (``s95``), and fxopt renames that symbol to the user's name, so that
every size of the captured step reads in the user's terms (``64*batch*seq**2``). Dimensions
given the same name are the same symbol: ``input_ids`` and ``labels`` share ``batch`` and
``seq`` even where the graph alone does not say so.

A captured graph is valid for the shapes its guards accept. A model may specialize a symbol
(branch on a size, treat a size of 1 apart): then the step captured is not one step for the
whole range, and `check_symbolic` says which dimension, which guard, and which line of the
model made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from fxopt.analysis.symbolic import Ranges, symbol
from fxopt.errors import CaptureError

NAMED_DIMS = {"batch": 0, "seq": 1}  # the names that stand for a dim of every tensor argument


@dataclasses.dataclass(frozen=True)
class DynamicDims:
    """The user's ``dynamic=``, checked: each name's range, and which dims it stands for."""

    ranges: Ranges
    spec: Mapping[Any, tuple[int, int]]

    @classmethod
    def parse(cls, dynamic: Mapping) -> DynamicDims:
        if not isinstance(dynamic, Mapping) or not dynamic:
            raise TypeError("dynamic= takes a dict of dimension names to (lo, hi) ranges, such as "
                            "{'batch': (1, 32), 'seq': (2, 512)}")
        bounds = {}
        for key, value in dynamic.items():
            name = dim_name(key)
            if isinstance(key, str) and key not in NAMED_DIMS:
                raise ValueError(f"dynamic= names {key!r}: fxopt knows 'batch' (dim 0 of every tensor argument) "
                                 "and 'seq' (dim 1); name any other dimension as (argument, dim), the argument "
                                 "by position or by name")
            if (not isinstance(value, (tuple, list)) or len(value) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                raise ValueError(f"dynamic[{key!r}] has no range: give the smallest and the largest size "
                                 f"it takes, as (lo, hi), not {value!r}")
            lo, hi = value
            if not 1 <= lo <= hi:
                raise ValueError(f"dynamic[{key!r}] = {value!r}: a range is (lo, hi) with 1 <= lo <= hi")
            bounds[name] = (lo, hi)
        return cls(Ranges(bounds), dict(dynamic))

    def dims(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int, str]]:
        """(tensor, dim, name) for every input dimension named, in the call ``model(*args, **kwargs)``."""
        out = []
        tensors = _tensor_arguments(args, kwargs)
        for key in self.spec:
            name = dim_name(key)
            if isinstance(key, str):
                d = NAMED_DIMS[key]
                found = [(t, d, name) for t in tensors if t.dim() > d]
            else:
                t = _argument(model, args, kwargs, key[0])
                d = key[1] if key[1] >= 0 else t.dim() + key[1]
                if not 0 <= d < t.dim():
                    raise ValueError(f"dynamic[{key!r}]: argument {key[0]!r} has {t.dim()} dims")
                found = [(t, d, name)]
            if not found:
                raise ValueError(f"dynamic[{key!r}]: no tensor argument of this call has that dimension")
            out.extend(found)
        return out

    def point(self, dims: list[tuple[torch.Tensor, int, str]]) -> dict[str, int]:
        """The shape of a call, by name; dims of one name must agree."""
        point: dict[str, int] = {}
        for t, d, name in dims:
            if point.setdefault(name, t.shape[d]) != t.shape[d]:
                raise ValueError(f"the dimensions dynamic= calls {name!r} differ in this call "
                                 f"({point[name]} and {t.shape[d]}); name them apart, as (argument, dim)")
        return point


def dim_name(key) -> str:
    """The name of a dimension given as ``"batch"`` or as ``(argument, dim)``."""
    if isinstance(key, str):
        return key
    if (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], (int, str))
            and isinstance(key[1], int)):
        return f"{key[0]}_{key[1]}".replace("-", "m")
    raise TypeError(f"dynamic= keys are 'batch', 'seq' or (argument, dim), not {key!r}")


def _tensor_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found, stack = [], [*reversed(kwargs.values()), *reversed(args)]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return found


def _argument(model, args: tuple, kwargs: dict, which) -> torch.Tensor:
    if isinstance(which, int):
        value = args[which] if which < len(args) else None
    elif which in kwargs:
        value = kwargs[which]
    else:
        try:
            value = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments.get(which)
        except TypeError:
            value = None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"dynamic= names argument {which!r}, which is not a tensor argument of this call")
    return value


def mark(dims: list[tuple[torch.Tensor, int, str]], ranges: Ranges) -> None:
    for t, d, name in dims:
        lo, hi = ranges.bounds[name]
        torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)


@contextlib.contextmanager
def capture_settings():
    """How fxopt asks Dynamo for dynamic shapes: only the marked dimensions are symbolic, two of
    them are never made one symbol because their sizes happen to be equal (duck sizing), and a
    size of 1 is not set apart where no op needs it (size-oblivious)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False), \
            torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True):
        yield


def symbol_names(gm: fx.GraphModule, dims: list[tuple[torch.Tensor, int, str]]) -> dict[sympy.Symbol, sympy.Symbol]:
    """Dynamo's symbol of each named input dimension -> the user's (from the captured graph's
    inputs, found by the tensors the user passed); a dimension Dynamo made static is refused."""
    by_tensor: dict[int, list[tuple[int, str]]] = {}
    for t, d, name in dims:
        by_tensor.setdefault(id(t), []).append((d, name))
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        example = getattr(arg, "example", None)
        if example is None or id(example) not in by_tensor:
            continue
        fake = node.meta.get("example_value")
        for d, name in by_tensor[id(example)]:
            size = fake.shape[d]
            expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
            if not expr.is_Symbol:
                source = f"{arg.source.name}.size()[{d}]"
                raise CaptureError(f"the captured step specializes {name!r}: {source} became {expr} "
                                   f"{_replacement_line(fake, source)}. {SPECIALIZED_ADVICE}")
            names[expr] = symbol(name)
    return names


class SpecializedError(CaptureError):
    """The captured step is one graph for part of the ranges only. ``holds``: (name, (lo, hi)),
    the widest end of that name's range where it is, when the guard is on one name (else None)."""

    def __init__(self, message: str, holds: tuple[str, tuple[int, int]] | None = None):
        super().__init__(message)
        self.holds = holds
        self.captured = None  # (a capture that stops to answer: its step, symbols' names and shape env)


SPECIALIZED_ADVICE = ("One plan for a range needs the step to be the same graph at every size in it: "
                      "narrow the range, or make the model not branch on that size")


def _replacement_line(fake, source: str) -> str:
    shape_env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        return ""
    for s, sources in shape_env.var_to_sources.items():
        if any(src.name == source for src in sources) and s in shape_env.replacements_slocs:
            return f"at {shape_env.replacements_slocs[s]}"
    return ""


def check_symbolic(shape_env, names: Mapping[sympy.Symbol, sympy.Symbol], ranges: Ranges) -> None:
    """Refuse a captured step that is not one graph for every shape in ``ranges``: a guard Dynamo
    or AOTAutograd made that some shape in the range fails (``seq != 1``), or a symbol's range
    narrowed. Names the guard, in the user's names, and the model's line that made it."""
    vr = ranges.value_ranges()
    for guard in shape_env.guards:
        expr = guard.expr.xreplace(dict(names))
        if expr is sympy.true or not expr.free_symbols <= set(vr):
            continue
        if not _always(expr, vr):
            holds = _where_it_holds(expr, vr)
            where = "" if holds is None else f" (it holds for {holds[0]} in {holds[1]}: a range within that one captures as one step)"
            raise SpecializedError(f"the captured step holds only where {expr}, not for every shape in "
                                   f"{dict(ranges.bounds)}{where}: the guard comes from {guard.sloc}. "
                                   f"{SPECIALIZED_ADVICE}", holds)
    for s, name in names.items():
        lo, hi = ranges.bounds[name.name]
        known = shape_env.var_to_range.get(s)
        if known is not None and (known.lower > lo or known.upper < hi):
            raise SpecializedError(f"the captured step holds only for {name} in [{known.lower}, {known.upper}], "
                                   f"not [{lo}, {hi}]{_narrowed_by(shape_env, s, names)}. {SPECIALIZED_ADVICE}",
                                   (name.name, (int(known.lower), int(known.upper))))


def _narrowed_by(shape_env, s, names) -> str:
    """Which guard narrowed symbol ``s``'s range, and where it comes from."""
    bounds = (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan)
    lines = [f"{g.expr.xreplace(dict(names))} at {g.sloc}" for g in shape_env.guards if s in g.expr.free_symbols and isinstance(g.expr, bounds)]
    return f": the guard {lines[0]}" if lines else ""


def _always(expr, vr) -> bool:
    return bool(bound_sympy(expr, vr).lower)


def _where_it_holds(expr, vr) -> tuple[str, tuple[int, int]] | None:
    """For a guard on one symbol, the widest end of its range on which the guard always holds,
    as (name, (lo, hi))."""
    if len(expr.free_symbols) != 1:
        return None
    (s,) = expr.free_symbols
    lo, hi = int(vr[s].lower), int(vr[s].upper)

    def holds(a: int, b: int) -> bool:
        return _always(expr, {**vr, s: ValueRanges(a, b)})

    options = []
    if holds(hi, hi):  # the smallest a from which it holds up to hi
        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            a, b = (a, mid) if holds(mid, hi) else (mid + 1, b)
        options.append((a, hi))
    if holds(lo, lo):
        a, b = lo, hi
        while a < b:
            mid = (a + b + 1) // 2
            a, b = (mid, b) if holds(lo, mid) else (a, mid - 1)
        options.append((lo, a))
    if not options:
        return None
    return s.name, max(options, key=lambda r: r[1] - r[0])
