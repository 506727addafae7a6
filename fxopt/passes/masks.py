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
from torch._guards import detect_fake_mode

aten = torch.ops.aten

MIN_BYTES = 4096
COMPUTE_ONCE = "fxopt_compute_once"


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


class _Builder:
    """Inserts nodes one after another, each with its fake value and the mask's metadata."""

    def __init__(self, graph: fx.Graph, after: fx.Node, meta_from: fx.Node):
        self.graph, self.anchor, self.meta_from = graph, after, meta_from
        self.fake_mode = detect_fake_mode([meta_from.meta["val"]])

    def __call__(self, op, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_after(self.anchor):
            node = self.graph.call_function(op, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*vals[0], **vals[1])
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        self.anchor = node
        return node


def _rewrite(graph: fx.Graph, mask: fx.Node, val: torch.Tensor) -> None:
    users = list(mask.users)
    n = val.numel()
    pad = (-n) % 8
    add = _Builder(graph, mask, mask)
    # pack: bool [n] -> uint8 [n/8], bit k of byte j = mask[8j + k]
    flat = add(aten.view.dtype, add(aten.view.default, mask, [n]), torch.uint8)
    if pad:
        flat = add(aten.constant_pad_nd.default, flat, [0, pad], 0.0)
    shifts = add(aten.arange.default, 8, dtype=torch.uint8, device=val.device)
    grouped = add(aten.view.default, flat, [(n + pad) // 8, 8])
    packed = add(aten.sum.dim_IntList, add(aten.bitwise_left_shift.Tensor, grouped, shifts), [1], False,
                 dtype=torch.uint8)
    packed.meta[COMPUTE_ONCE] = True
    # unpack: uint8 [n/8] -> bool [n] -> the mask's shape
    shifts_again = add(aten.arange.default, 8, dtype=torch.uint8, device=val.device)
    bits = add(aten.bitwise_and.Scalar,
               add(aten.bitwise_right_shift.Tensor, add(aten.unsqueeze.default, packed, 1), shifts_again), 1)
    flat_bits = add(aten.view.default, bits, [n + pad])
    if pad:
        flat_bits = add(aten.slice.Tensor, flat_bits, 0, 0, n)
    unpacked = add(aten.view.default, add(aten.ne.Scalar, flat_bits, 0), list(val.shape))
    for user in users:
        user.replace_input_with(mask, unpacked)
