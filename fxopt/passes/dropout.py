"""Make dropout's output recomputable from its mask.

``native_dropout`` draws random numbers, so it must run once, where eager runs it, and nothing
may recompute it. Its output is needed by the backward of whatever reads it (the ``bmm`` after
attention dropout reads a float tensor as large as the attention matrix), so without this pass
that output must be SAVEd in every layer. But the output is a plain function of the input and the
boolean mask the op also returns::

    out, mask = native_dropout(x, p, True)      out, mask = native_dropout(x, p, True)
    y = bmm(out, v)                       ==>   out2 = masked_scale(x, mask, 1 / (1 - p))
                                                y = bmm(out2, v)

and every reader of ``out`` reads ``out2`` instead. ``masked_scale(x, mask, s)`` is ``where(mask,
x, 0) * s`` computed into one output buffer: ``mul(mul(x, mask), s)`` (what the CPU kernel does)
first copies the mask to a float tensor, twice the memory while it runs. The same op replaces
``native_dropout_backward(grad, mask, s)``, for the same reason. ``out2`` is recomputable (from ``x``, itself
recomputable, and ``mask``, which is SAVEd at a quarter of the size), so the solver may SAVE or
RECOMPUTE it like any other value. For float32 and float64 ``out2`` equals ``out`` bit for bit
on CPU and CUDA where the mask keeps ``x``: multiplying by 1 is exact, so both round ``x * scale``
once; where it drops ``x`` the result is +0.0 where eager's ``x * 0`` gives -0.0 for negative
``x`` (equal values; NaN only if ``x`` is not finite). Other dtypes
(half, bfloat16 kernels round the scale first, differently per device) are left alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxopt.ops  # noqa: F401 - registers torch.ops.fxopt.*
from fxopt.fxgraph import EAGER_COPIES, NodeBuilder, aliases_input, replace_node, replace_value

aten = torch.ops.aten

EXACT_DTYPES = (torch.float32, torch.float64)


def recompute_dropout_from_mask(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; return how many dropouts were rewritten."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if train is False or not isinstance(p, float) or not 0.0 <= p < 1.0:
            continue
        if not isinstance(x_val, torch.Tensor) or x_val.dtype not in EXACT_DTYPES:
            continue
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        out = outs.get(0)
        if out is None or not out.users:
            continue
        mask = outs.get(1)
        if mask is None:
            with graph.inserting_after(out):
                mask = graph.call_function(operator.getitem, (node, 1))
            mask.meta.update(out.meta)
            mask.meta["val"] = node.meta["val"][1]
        add = NodeBuilder(graph, max(out, mask, key=lambda n: _position(graph, n)), out)
        out2 = add(torch.ops.fxopt.masked_scale.default, x, mask, 1.0 / (1.0 - p))
        replace_value(out, out2)
        graph.erase_node(out)  # the op's first output now dies with the op's result tuple
        rewritten += 1
    for node in list(graph.find_nodes(op="call_function", target=aten.native_dropout_backward.default)):
        grad, mask, scale = node.args[0], node.args[1], node.args[2]
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype not in EXACT_DTYPES or not isinstance(scale, float):
            continue
        replace_node(graph, node, torch.ops.fxopt.masked_scale.default, grad, mask, scale)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


# What ``source_fn_stack`` names for a dropout: its modules' base class, its functions.
_DROPOUT_MODULE = torch.nn.modules.dropout._DropoutNd
_DROPOUT_FUNCTIONS = frozenset([
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
])


def alias_identity_dropouts(gm: fx.GraphModule) -> int:
    """A dropout that drops nothing (``p=0``, or not training) returns its input itself in eager,
    but AOTAutograd's decomposition returns ``input.clone()``: a copy eager never makes, which
    the step would hold wherever the backward reads it (T5's feed-forward: its ReLU output twice).
    Make every reader of such a copy read the input instead::

        y = clone(x)   # from dropout(x, 0.0)    ==>   (y's readers read x)

    Only a copy with its input's layout, that is no output of the step, of a value nothing
    writes to (a functional graph writes only to its inputs, at the end). Returns how many.

    A copy of another layout stays (its readers' views need its dense layout: XLNet's dropout of
    its expanded position embeddings). Eager has no copy there, but each reshape of the strided
    input that cannot be a view makes one, one for each of the layers that read it: the copy is
    marked with how many eager makes at most (``meta[EAGER_COPIES]``, the reshapes reached
    through views), which the eager peak counts (`fxopt.analysis`'s ``eager_bytes``)."""
    for node in _identity_copies(gm.graph, same_layout=False):
        node.meta[EAGER_COPIES] = _reshapes_of(node)
    copies = _identity_copies(gm.graph)
    for node in copies:
        replace_value(node, node.args[0])
        gm.graph.erase_node(node)
    if copies:
        gm.graph.lint()
        gm.recompile()
    return len(copies)


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _reshapes_of(node: fx.Node) -> int:
    """The reshapes among the views of ``node`` (and of views of them)."""
    count, stack, seen = 0, list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen or u.op != "call_function" or not aliases_input(u.target):
            continue
        seen.add(u)
        count += u.target in _RESHAPES
        stack.extend(u.users)
    return count


def _identity_copies(graph: fx.Graph, same_layout: bool = True) -> list[fx.Node]:
    """The copies `alias_identity_dropouts` removes (``same_layout=False``: those of another
    layout, which it leaves)."""
    written = {n.args[0] for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable and n.args and isinstance(n.args[0], fx.Node)}

    def identity(node: fx.Node) -> bool:
        source, val = node.args[0], node.meta.get("val")
        before = source.meta.get("val") if isinstance(source, fx.Node) else None
        return (_from_dropout(node) and source not in written and isinstance(val, torch.Tensor)
                and isinstance(before, torch.Tensor) and not any(u.op == "output" for u in node.users)
                and ((val.shape, val.stride(), val.dtype, val.device) == (before.shape, before.stride(), before.dtype,
                                                                          before.device)) == same_layout)

    return [n for n in graph.find_nodes(op="call_function", target=aten.clone.default) if identity(n)]


def _from_dropout(node: fx.Node) -> bool:
    stack = node.meta.get("source_fn_stack") or []
    if not stack or not isinstance(stack[-1], tuple) or len(stack[-1]) < 2:
        return False
    source = stack[-1][1]
    if isinstance(source, type):
        return issubclass(source, _DROPOUT_MODULE)
    return source in _DROPOUT_FUNCTIONS


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for k, n in enumerate(graph.nodes):
        if n is node:
            return k
    raise ValueError(node)
