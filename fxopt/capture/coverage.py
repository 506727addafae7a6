"""Whether the graphs fxopt planned cover the step that ran: the check after each call.

A plan bounds what runs inside the graphs fxopt captured. Whatever Dynamo ran eagerly instead (a
frame it skipped, code between graph breaks) is outside every plan. The autograd graph of the
call's outputs shows it: each operation that ran in this call and will run a backward has a node
there, and the nodes of fxopt's graphs are known. Autograd numbers the nodes as it makes them, so
each piece records the numbers its call made (holding no node: a Python reference to an autograd
node kept past its step crashed the garbage collector), and the walk covers the nodes made in this
call (older ones belong to what the caller did before):

    loss ─▶ NllLossBackward ─▶ LogSoftmaxBackward ─▶ CompiledFunctionBackward (fxopt's) ─▶ AccumulateGrad
            └──────── computed outside the plan: refused ────────┘

  - a step planned whole admits no other computation: only views (an output AOTAutograd
    regenerates as a view of the graph's), gradient accumulation, and the identity functions
    module hooks and DDP or FSDP2 wrap around a step (``glue``);
  - a step planned in pieces admits operations between the pieces that keep, for their backward,
    no tensor the pieces' reserves do not count (an add, a view: glue Dynamo left between blocks,
    whose outputs the next piece counts as its inputs; see `fxopt.capture.pieces`).

What neither rule can see: memory that eager code allocates and frees within the forward, and
tensors it keeps that no backward reads (outside every plan too; the pieces' docstring says so).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fxopt.errors import CaptureError
from fxopt.storage import storage_key, tensors_in

# Autograd nodes of identity functions that wrap a step: module backward hooks (torch.utils.hooks).
HOOK_NODES = ("BackwardHookFunctionBackward",)

SKIP_ADVICE = (
    "Dynamo ran that code eagerly. It does for the whole of a function that loops over a graph break "
    "(a break inside a layer makes the model's forward that loops over the layers run eagerly around "
    "them: Dynamo cannot resume inside a loop), for the Python between graph breaks, for a function "
    "torch.compiler.disable wraps, and for one an earlier torch.compile in this process marked to skip "
    "(one that ran under a TorchDispatchMode such as FlopCounterMode marks the frames it met for good: "
    "call torch._dynamo.reset() before planning); run the model once under "
    "torch.compile(model, fullgraph=True) to see where it breaks.")


def sequence_number() -> int:
    """Autograd's count of the nodes made so far in this thread: a node made later has a larger one."""
    return torch.autograd._get_sequence_nr()


def nodes_made_since(outputs: Any, since: int) -> Iterator:
    """The autograd nodes behind the tensors in ``outputs`` that were made at or after ``since``
    (gradient accumulators aside: those belong to the leaves)."""
    stack = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < since:
            continue
        yield node
        stack.extend([n for n, _ in node.next_functions])  # (a list: a generator is a Python call per item)


@functools.lru_cache(maxsize=None)
def _is_view_node(name: str) -> bool:
    """Whether an autograd node named ``name`` (``ViewBackward0``) is the backward of an aten
    view (an op whose output aliases its input, by its schema)."""
    match = re.fullmatch(r"([A-Z]\w*?)Backward\d*", name)
    if match is None:
        return False
    op = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write
               for overload in packet.overloads() for r in getattr(packet, overload)._schema.returns)


def kept_tensors(node) -> list[torch.Tensor]:
    """The tensors autograd keeps for ``node``'s backward."""
    kept = []
    for name in dir(node):
        if name.startswith("_saved_"):
            value = getattr(node, name)
            kept.extend(v for v in (value if isinstance(value, (list, tuple)) else [value])
                        if isinstance(v, torch.Tensor))
    return kept


def _named(nodes: Iterable) -> str:
    found: dict[str, int] = {}
    for node in nodes:
        found[type(node).__name__] = found.get(type(node).__name__, 0) + 1
    return ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in sorted(found.items()))


def made_in(spans: Iterable[tuple[int, int]]) -> Callable[[Any], bool]:
    """Whether an autograd node was made in one of ``spans`` (from, to) of `sequence_number`s."""
    spans = list(spans)
    return lambda node: any(lo <= node._sequence_nr() < hi for lo, hi in spans)


def check_whole(outputs: Any, since: int, planned: Callable[[Any], bool], glue: tuple[str, ...]) -> None:
    """Refuse a step planned as one graph in which anything but views and ``glue`` was computed
    outside the graphs fxopt planned (``planned(node)``; see the module docstring)."""
    outside = [node for node in nodes_made_since(outputs, since) if not planned(node)
               and not _is_view_node(type(node).__name__) and not type(node).__name__.startswith(glue)]
    if outside:
        raise CaptureError(
            "part of this training step ran outside the graph fxopt captured and planned as the whole "
            f"step, so the budget does not hold for it: {_named(outside)}. {SKIP_ADVICE}")


def check_pieces(outputs: Any, since: int, planned: Callable[[Any], bool], counted: set, glue: tuple[str, ...],
                 advice: str) -> None:
    """Refuse a step in pieces in which an operation outside the pieces (``planned(node)``) keeps,
    for its backward, a tensor no plan or reserve counts (``counted``: the storages that are,
    resident or returned by a piece). ``advice``: what to do about it."""
    outside = [node for node in nodes_made_since(outputs, since)
               if not planned(node) and not type(node).__name__.startswith(glue)
               and any(storage_key(t) not in counted for t in kept_tensors(node))]
    if outside:
        raise CaptureError(
            "part of this training step ran eagerly, outside fxopt's plans, and keeps tensors for its "
            f"backward that no plan counts: {_named(outside)}. {advice}")
