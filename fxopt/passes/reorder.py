"""Run the captured step's ops in the memory-aware order the planner chose (`fxopt.solvers.order`).

    captured:  mm_1 = mm(t, a1); mm_2 = mm(t, a2); mm_3 = mm(t, w); ...
    reordered: mm_3 = mm(t, w); mm_1 = mm(t, a1); mm_2 = mm(t, a2); ...

The joint graph's nodes move (placeholders stay first, in the calling convention's order; the
output stays last) in a copy of the module, and the solver's view moves with them (`JointGraph`:
its graph, names, module paths and codecs), so the simulator, the solvers and the generated code
(`fxopt.passes.recompute` extracts the forward in graph order) walk the same order and the
predicted peak stays the generated code's.

Side effects stay where they were: the ops that cannot be recomputed (random ops, mutations,
collectives) keep their order among themselves (`fxopt.solvers.order`), and so do the
collectives a re-gather may recompute (`collectives`: all-gathers and their waits); every op that
may write into a value (`barriers`: a schema marked mutable, or anything but an aten op and
``getitem``) is a barrier no node moves across. A step with dynamic shapes keeps its order (its
sizes are computed by nodes the solver graph does not show).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch

from fxopt.analysis import JointGraph
from fxopt.fxgraph import copy_module
from fxopt.solvers.order import Order, choose_order, reordered as in_graph_order

# The namespaces of the ops that talk to other ranks.
COLLECTIVES = ("_c10d_functional", "c10d_functional", "_dtensor", "c10d")


def barriers(joint: JointGraph) -> frozenset[int]:
    """The solver-graph indices of the ops that may write into a value (see the module)."""
    index = {name: i for i, name in enumerate(joint.names)}
    out = set()
    for n in joint.module.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or n.target is operator.getitem:
            continue
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
            out.add(index[n.name])
    return frozenset(out)


def collectives(joint: JointGraph) -> frozenset[int]:
    """The solver-graph indices of the collectives and their waits (`COLLECTIVES`), which keep
    their captured order among themselves: every rank runs them in the same order."""
    index = {name: i for i, name in enumerate(joint.names)}
    return frozenset(index[n.name] for n in joint.module.graph.nodes
                     if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in COLLECTIVES)


def reorder_step(joint: JointGraph, solver: str = "auto", **lowest) -> tuple[JointGraph, Order] | None:
    """The step in the order `fxopt.solvers.order.choose_order` accepts (``solver`` and ``lowest``:
    how it searches each order's lowest peak), in a copy of its module, and that order; None
    where the captured order stands (none accepted, or dynamic shapes)."""
    if joint.symbolic is not None:
        return None
    chosen = choose_order(joint.graph, barriers(joint), collectives(joint), solver, **lowest)
    if chosen is None:
        return None
    return in_order(joint, chosen.order), chosen


def in_plan_order(joint: JointGraph, names: Sequence[str], reordered: bool = True) -> JointGraph | None:
    """The step with its nodes in the order of ``names`` (a plan's graph's, to replay it);
    ``reordered``: whether that is an order fxopt chose (else the captured one). None where they
    are not this step's nodes."""
    index = {name: i for i, name in enumerate(joint.names)}
    if len(names) != len(index) or set(names) != set(index):
        return None
    try:
        return in_order(joint, [index[name] for name in names], reordered)
    except ValueError:
        return None


def in_order(joint: JointGraph, order: Sequence[int], reordered: bool = True) -> JointGraph:
    """``joint`` with its nodes in ``order`` (``order[k]``: the index of the node that runs k-th),
    in a copy of its module; ``reordered``: whether that is an order fxopt chose. Raises
    ValueError for an order that moves a placeholder or breaks a dependency."""
    graph = in_graph_order(joint.graph, order)  # (checks the order against the solver graph)
    module = copy_module(joint.module)
    by_name = {n.name: n for n in module.graph.nodes}
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    names = [joint.names[i] for i in order]
    in_fx = [name for name in names if name in by_name]
    if in_fx[:len(placeholders)] != placeholders:
        raise ValueError("an order must keep the placeholders first, in their order")
    output = next(iter(module.graph.find_nodes(op="output")))
    for name in in_fx[len(placeholders):]:
        output.prepend(by_name[name])
    module.graph.lint()  # (every node after its inputs)
    module.recompile()
    new = {old: k for k, old in enumerate(order)}
    return dataclasses.replace(joint, module=module, graph=graph, names=tuple(names),
                               module_paths=tuple(joint.module_paths[i] for i in order),
                               codecs={new[i]: codec for i, codec in joint.codecs.items()}, reordered=reordered)
