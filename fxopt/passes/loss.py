"""The cross-entropy loss's backward without its dense incoming gradient beside its result.

``cross_entropy`` is ``log_softmax`` then ``nll_loss``. Its backward, as AOTAutograd traces it::

    G = nll_loss_backward(g, lsm, target, weight, reduction, ignore_index, total_weight)   # N x C
    dX = _log_softmax_backward_data(G, lsm, 1, dtype)                                       # N x C

holds three tensors of the logits' size at once: the log-probabilities ``lsm``, ``G`` (zero but
one entry per row: ``s_i = G[i, target_i]``) and ``dX = G - exp(lsm) * G.sum(1)``. On a language
model's head (tokens x vocabulary) that is the step's peak wherever the blocks are recomputed (the
bench GPT-NeoX's 2-rank FSDP step: 6 of its 9.06 MiB floor). The same values, two at a time::

    s  = gather(G, 1, t)                    # G, lsm       (t: the target, ignored rows at 0)
    e  = exp(lsm)                           # lsm, e       (G gone)
    m  = e * -s                             # e, m         (lsm gone, where nothing else reads it)
    dX = scatter_add(m, 1, t, s)            # m, dX

Exact where eager's kernel rounds as written: ``G.sum(1)`` of one entry is ``s_i``, so each
entry off the target is ``-(e * s_i)`` in both, and the target's ``s_i + -(e * s_i)`` is
``s_i - e * s_i`` (a kernel that fuses the multiply-add rounds once: within float32's tolerance).
An ignored row's ``G`` is all zeros, so its ``s_i`` is 0 (gathered at column 0). Only float32 and
float64, rows of 2-D logits (``dim`` 1), ``lsm`` in the dtype the backward returns, and a ``G``
nothing else reads.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.fxgraph import NodeBuilder, replace_value, rewrite_each

aten = torch.ops.aten

EXACT_DTYPES = (torch.float32, torch.float64)


def sparse_loss_backward(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; return how many loss backwards were rewritten."""
    graph = gm.graph

    def rewrite(node: fx.Node) -> bool:
        grad, lsm, dim, dtype = node.args[:4]
        if not _rewritable(grad, lsm, dim, dtype):
            return False
        target, ignore_index = grad.args[2], grad.args[5]
        add = NodeBuilder(graph, node.prev, node)
        ignored = add(aten.eq.Scalar, target, ignore_index)
        column = add(aten.unsqueeze.default, add(aten.masked_fill.Scalar, target, ignored, 0), 1)
        picked = add(aten.gather.default, grad, 1, column)
        scaled = add(aten.mul.Tensor, add(aten.exp.default, lsm), add(aten.neg.default, picked))
        replace_value(node, add(aten.scatter_add.default, scaled, 1, column, picked))
        graph.erase_node(node)
        return True

    return rewrite_each(gm, aten._log_softmax_backward_data.default, rewrite)


def _rewritable(grad, lsm, dim, dtype) -> bool:
    if not (isinstance(grad, fx.Node) and grad.target is aten.nll_loss_backward.default and len(grad.users) == 1):
        return False
    g_val, lsm_val = grad.meta.get("val"), lsm.meta.get("val") if isinstance(lsm, fx.Node) else None
    target = grad.args[2]
    t_val = target.meta.get("val") if isinstance(target, fx.Node) else None
    return (isinstance(g_val, torch.Tensor) and isinstance(lsm_val, torch.Tensor) and isinstance(t_val, torch.Tensor)
            and g_val.dim() == 2 and t_val.dim() == 1 and dim in (1, -1) and lsm_val.dtype in EXACT_DTYPES
            and lsm_val.dtype == dtype == g_val.dtype and isinstance(grad.args[5], int))
