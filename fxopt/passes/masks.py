"""SAVE dropout masks as packed bits (COMPRESS, lossless), not one byte per element.

Dropout's boolean mask comes from a random op, so it can never be recomputed: whatever reads it in
the backward (dropout's backward, or recomputing dropout's output from it, see
`fxopt.passes.dropout`) needs it SAVEd. A ``bool`` tensor spends a byte per element on one bit::

    out, mask = native_dropout(x, p, True)          out, mask = native_dropout(x, p, True)
    y = mul(x, mask)                          ==>   packed = pack(mask)       # n / 8 bytes, SAVEd
    ... native_dropout_backward(g, mask, s)         unpacked = unpack(packed) # made where needed
                                                    y = mul(x, unpacked)
                                                    ... native_dropout_backward(g, unpacked, s)

``pack`` and ``unpack`` are a handful of aten ops (shift, sum, and, compare) that run on any
device; ``unpack(pack(m))`` equals ``m`` exactly, so the step is bit-identical to eager. The
packed tensor is marked to be computed once (``meta["fxopt_compute_once"]``), so the solver keeps
it rather than the mask, which dies in the forward right after packing. Masks smaller than
``MIN_BYTES`` are left alone: packing them saves less than the ops cost.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxopt.passes._fx import COMPUTE_ONCE, NodeBuilder, tangent_dependents

aten = torch.ops.aten

MIN_BYTES = 4096

# ReLU masks (`pack_relu_masks`) are off by default for now: they add a choice (packed mask or the
# float output) that the heuristics handle poorly (on the test MLP the greedy's lowest peak rose
# by 1%); on once the solver chooses COMPRESS per tensor (issue 6). Dropout masks are always packed.
PACK_RELU = False


def pack_dropout_masks(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as above; return how many masks were packed."""
    graph = gm.graph
    packed_count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        mask = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None)
        if mask is None or not mask.users:
            continue
        val = mask.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.numel() < MIN_BYTES:
            continue
        if not val.is_contiguous():
            continue
        _rewrite(graph, mask, val)
        packed_count += 1
    if packed_count:
        graph.lint()
        gm.recompile()
    return packed_count


# pack_bits(x, threshold, mode): bit k of byte j is 1 where element 8j + k of x is "on": x itself
# for a bool mask (mode 0), x <= threshold (mode 1). One op, so that what the backward needs is one
# value made from forward values, which the forward can compute and SAVE.
@torch.library.custom_op("fxopt::pack_bits", mutates_args=())
def pack_bits(x: torch.Tensor, threshold: float, mode: int) -> torch.Tensor:
    on = x if mode == 0 else x <= threshold
    flat = on.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


@pack_bits.register_fake
def _(x, threshold, mode):
    return x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op("fxopt::unpack_bits", mutates_args=())
def unpack_bits(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].ne(0).view(shape)


@unpack_bits.register_fake
def _(packed, shape):
    return packed.new_empty(shape, dtype=torch.bool)


def _rewrite(graph: fx.Graph, mask: fx.Node, val: torch.Tensor) -> None:
    users = list(mask.users)
    add = NodeBuilder(graph, mask, mask)
    packed = add(torch.ops.fxopt.pack_bits.default, mask, 0.0, 0)
    packed.meta[COMPUTE_ONCE] = True
    unpacked = add(torch.ops.fxopt.unpack_bits.default, packed, list(val.shape))
    for user in users:
        user.replace_input_with(mask, unpacked)


def pack_relu_masks(gm: fx.GraphModule) -> int:
    """ReLU's backward, ``threshold_backward(grad, out, t)``, reads ``out`` only for ``out <= t``.
    Where nothing else in the backward reads ``out``, give it that as packed bits instead::

        g = threshold_backward(grad, out, 0)   ==>   packed = pack(out <= 0)    # SAVEd, n / 8 bytes
                                                     g = where(unpack(packed), 0, grad)

    ``where(out <= t, 0, grad)`` is what the kernel computes (NaN included), so gradients are
    bit-identical; ``out`` (4 bytes an element) no longer has to survive the forward for it.
    Returns how many were rewritten."""
    graph = gm.graph
    backward = tangent_dependents(graph)
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.threshold_backward.default)):
        grad, out, threshold = node.args[0], node.args[1], node.args[2]
        while isinstance(out, fx.Node) and out.target in (aten.detach.default, aten.alias.default):
            out = out.args[0]  # AOTAutograd hands the backward a detached alias of ReLU's output
        val = out.meta.get("val") if isinstance(out, fx.Node) else None
        if not isinstance(val, torch.Tensor) or out in backward or val.numel() < MIN_BYTES:
            continue
        if _read_by_backward(out, backward, besides=node):
            continue  # the backward reads `out` anyway (a weight gradient, say): nothing to gain
        add = NodeBuilder(graph, out, out)
        # Not compute-once, unlike a dropout mask: `out` can be recomputed, so the solver chooses
        # between SAVEing the packed mask and recomputing it (from a SAVEd `out`, or further back).
        packed = add(torch.ops.fxopt.pack_bits.default, out, float(threshold), 1)
        unpacked = add(torch.ops.fxopt.unpack_bits.default, packed, list(val.shape))
        new = NodeBuilder(graph, node.prev, node)(aten.where.ScalarSelf, unpacked, 0.0, grad)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


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
            if isinstance(target, torch._ops.OpOverload) and (target.is_view or target is aten.detach.default):
                stack.append(u)
    return False
