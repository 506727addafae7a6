"""ReLU's backward made to read a bool mask instead of ReLU's float output (packed as bits by
the ``bits`` codec, `fxopt.ops.bits`).

The solver may then keep that mask, like any SAVEd bool tensor of at least ``MIN_BYTES`` (a
dropout mask, a comparison), COMPRESSed as packed bits: n / 8 bytes instead of n, decoded just
before the backward reads it, exactly, so gradients stay bit-identical to eager.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import fxopt.ops  # noqa: F401 - registers torch.ops.fxopt.*
from fxopt.analysis.codecs import MIN_BYTES
from fxopt.analysis.symbolic import largest
from fxopt.fxgraph import ALIAS_OPS, NodeBuilder, aliases_input, replace_node, rewrite_each, tangent_dependents

aten = torch.ops.aten


RELU_MASK = "fxopt_relu_mask"  # meta key of a rewritten ReLU backward: the output it read


def relu_masks(gm: fx.GraphModule) -> int:
    """ReLU's backward, ``threshold_backward(grad, out, t)``, reads ``out`` only for ``out <= t``.
    Where nothing else in the backward reads ``out``, give it that as a bool mask instead::

        g = threshold_backward(grad, out, 0)   ==>   mask = le(out, 0)             # 1 byte an element
                                                     g = where(mask, 0, grad)

    ``where(out <= t, 0, grad)`` is what the kernel computes (NaN included), so gradients are
    bit-identical. The mask is a forward value like any other: the solver SAVEs it (4× smaller
    than a float32 ``out``), COMPRESSes it as bits (32×), or recomputes it. Returns how many were
    rewritten."""
    graph = gm.graph
    backward = tangent_dependents(graph)
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.threshold_backward.default)):
        grad, out, threshold = node.args[0], node.args[1], node.args[2]
        while isinstance(out, fx.Node) and out.target in ALIAS_OPS:
            out = out.args[0]  # AOTAutograd hands the backward a detached alias of ReLU's output
        val = out.meta.get("val") if isinstance(out, fx.Node) else None
        if not isinstance(val, torch.Tensor) or out in backward or largest(val.numel()) < MIN_BYTES:
            continue
        if _read_by_backward(out, backward, besides=node):
            continue  # the backward reads `out` anyway (a weight gradient, say): nothing to gain
        mask = NodeBuilder(graph, out, out)(aten.le.Scalar, out, threshold)
        read = node.args[1]
        new = replace_node(graph, node, aten.where.ScalarSelf, mask, 0.0, grad)
        new.meta[RELU_MASK] = read  # what `undo_relu_masks` gives back to the backward
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def undo_relu_masks(gm: fx.GraphModule) -> int:
    """Undo `relu_masks`: ReLU's backward reads ReLU's output again. (fxopt plans without the
    masks when no plan with them fits the budget: the solvers do not always find the lowest peak
    of the rewritten step.) Returns how many were undone."""
    graph = gm.graph

    def undo(node: fx.Node) -> bool:
        if RELU_MASK not in node.meta:
            return False
        mask, grad = node.args[0], node.args[2]
        out, threshold = node.meta.pop(RELU_MASK), mask.args[1]
        replace_node(graph, node, aten.threshold_backward.default, grad, out, threshold)
        if not mask.users:
            graph.erase_node(mask)
        return True

    return rewrite_each(gm, aten.where.ScalarSelf, undo)


def _read_by_backward(value: fx.Node, backward: set[fx.Node], besides: fx.Node) -> bool:
    """Whether a backward node other than `besides` reads `value` or a view of it."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            if u is besides:
                continue
            if u in backward:
                return True
            target = getattr(u, "target", None)
            if aliases_input(target):
                stack.append(u)
    return False
