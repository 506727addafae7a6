"""The cross-entropy loss's backward written into its incoming gradient's buffer.

``cross_entropy`` is ``log_softmax`` then ``nll_loss``. Its backward, as AOTAutograd traces it::

    G  = nll_loss_backward(g, lsm, target, weight, reduction, ignore_index, total_weight)   # N x C
    dX = _log_softmax_backward_data(G, lsm, dim, dtype)                                     # N x C

holds three tensors of the logits' size at once: the log-probabilities ``lsm``, ``G`` and ``dX``.
On a language model's head (tokens x vocabulary) that is the step's peak wherever the blocks are
recomputed (the bench GPT-NeoX's 2-rank FSDP step: 6 of its 9.06 MiB floor). Where nothing but
that op reads ``G``, eager's own kernel writes ``dX`` over it::

    dX = _log_softmax_backward_data.out(G, lsm, dim, dtype, out=G)                          # G, lsm

the same kernel on the same inputs: bit-equal to eager (each row's sum of ``G`` is read before
the row is written, on CPU and in CUDA's softmax kernels alike), with two logits-sized tensors
alive, not three. The node's fake value is ``G``'s, so the analysis counts ``dX`` as ``G``'s
storage (no allocation; `fxopt.analysis.joint`), and its op mutates, so it is never recomputed
nor moved (`Node.recomputable`). ``G`` is a backward value, made once; its one reader is this op.

Inductor's graphs must be functional: under ``compiler="inductor"`` the step is planned and
compiled without this rewrite, and Inductor does not reuse ``G``'s buffer for ``dX`` either
(measured on CPU: a plan compiled by Inductor peaks at the three logits).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.fxgraph import replace_node, rewrite_each, same_layout

aten = torch.ops.aten


def loss_backward_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; return how many loss backwards were rewritten."""
    graph = gm.graph

    def rewrite(node: fx.Node) -> bool:
        grad, lsm, dim, dtype = node.args[:4]
        if not _rewritable(node, grad, lsm, dtype):
            return False
        replace_node(graph, node, aten._log_softmax_backward_data.out, grad, lsm, dim, dtype, out=grad)
        return True

    return rewrite_each(gm, aten._log_softmax_backward_data.default, rewrite)


def _rewritable(node: fx.Node, grad, lsm, dtype) -> bool:
    """Whether ``G`` may hold the result: made by the loss's backward for this op alone, and of
    the result's shape, strides and dtype."""
    if not (isinstance(grad, fx.Node) and grad.target is aten.nll_loss_backward.default and len(grad.users) == 1
            and isinstance(lsm, fx.Node)):
        return False
    g_val, out_val = grad.meta.get("val"), node.meta.get("val")
    return same_layout(g_val, out_val) and g_val.dtype == dtype and g_val.is_contiguous()
