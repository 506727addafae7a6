"""Gradients summed in place, as eager's autograd engine sums them.

Where a value is read twice in the forward, autograd's engine sums its two gradients. AOTAutograd
traces that sum as a new tensor (``add``, tagged with torch's `GRADIENT_ACC_SPECIAL_STACK`), so
the traced backward holds both gradients and their sum at once. Eager's engine writes the sum over
one of the two where it holds the last reference to it (``InputBuffer::accumulate``): one
gradient-sized tensor less. A loop that reads a tensor at each step (a selective scan's state
slices: transformers' Mamba with ``use_associative_scan=False``) sums a whole-tensor gradient per
step, and the traced sums' extra tensor was the step's peak: 8% above eager's measured peak.

Where the operand is free (`fxopt.fxgraph.accumulates_into`: made in the backward, read by the
sum alone), the sum is written over it::

    s = add(a, b)        ->        s = add.out(a, b, out=a)

the same IEEE additions, bit-equal. The node's fake value is ``a``'s (taken, not made again: ``add.out``
returns ``out``, of the sum's shape, strides and dtype), so the analysis counts ``s``
in ``a``'s storage (no allocation), and its op mutates, so it is never recomputed nor moved
(`Node.recomputable`). The eager step's prediction counts the same sums in place
(`fxopt.analysis.joint`, `Node.eager_in_place`), so a fraction of eager's peak and fxopt's step at
``1.0`` agree there. Inductor's graphs must be functional: under ``compiler="inductor"`` this is
not applied (Inductor reuses buffers itself where its own plan allows).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.fxgraph import accumulates_into, replace_node, rewrite_each

aten = torch.ops.aten


def sum_gradients_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; return how many sums were written over an operand."""
    graph = gm.graph

    def rewrite(node: fx.Node) -> bool:
        into = accumulates_into(node)
        if into is None:
            return False
        # (``add.out`` returns ``out``: its fake value is the operand's, of the sum's layout, so
        # not run again under fake tensors; the views of the sum are made again from it)
        replace_node(graph, node, aten.add.out, *node.args, out=into, fake=into.meta["val"])
        return True

    return rewrite_each(gm, aten.add.Tensor, rewrite)
