"""Decompose the ops of a forward or backward module in place, node by node.

Used before Inductor compiles fxopt's modules. fxopt plans on the joint graph without
decompositions (random ops stay whole; the simulator's nodes are eager's kernels); Inductor wants
its own decompositions, and an op it has no lowering for becomes a fallback kernel whose inputs it
first copies to contiguous memory (in the backward), a temporary the plan does not know. So the
split modules are decomposed here, each node replaced by its decomposition at its own position:
the order the schedule chose and the values the forward saves do not change.

    before:  b = threshold_backward(g, a, 0)
    after:   le = le(a, 0); s = scalar_tensor(0); b = where(le, s, g)

Random ops are left whole, so they draw the same numbers as eager. Annotations of a node's value
(`MARKS`) move to the node that now produces it. Every node is marked with the op it comes from
(``meta[OP]``: the name of the node it decomposes, or its own), the one kernel the simulator
counts for all of them (`fxopt.capture.inductor` fuses within it).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

# Node annotations that belong to the value, not to the op: the decomposition's result inherits them.
MARKS = ("inductor_realize_to_strides",)
# The node annotation naming the op (before decomposition) a node computes part of.
OP = "fxopt_op"


def decompose(gm: fx.GraphModule, table: Mapping[torch._ops.OpOverload, Callable]) -> fx.GraphModule:
    """Replace each node whose op is in ``table`` (random ops excepted) by its decomposition,
    traced on the node's fake values. Returns ``gm``, changed in place."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        node.meta.setdefault(OP, node.name)
        if not _decomposable(node, table):
            continue
        inputs = node.all_input_nodes
        sub = _decomposition(node, table)
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        anchor = node.prev  # (the copy goes between it and the node: those nodes are the decomposition's)
        with graph.inserting_before(node):
            out = graph.graph_copy(sub.graph, dict(zip(placeholders, inputs)))
        made = node.prev
        while made is not anchor:
            made.meta[OP] = node.meta[OP]
            made = made.prev
        if isinstance(out, fx.Node):
            _keep_marks(node, out)
            node.replace_all_uses_with(out)
        else:
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise AssertionError(f"{user.name} reads the tuple {node.name} whole")
                _keep_marks(user, out[user.args[1]])
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _keep_marks(old: fx.Node, new: fx.Node) -> None:
    for key in MARKS:
        if key in old.meta:
            new.meta[key] = old.meta[key]


def _decomposable(node: fx.Node, table: Mapping[torch._ops.OpOverload, Callable]) -> bool:
    """Whether ``decompose`` replaces ``node``: an op of ``table``, not a random one, its inputs' values known."""
    return (node.op == "call_function" and node.target in table
            and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
            and all("val" in n.meta for n in node.all_input_nodes))


def _decomposition(node: fx.Node, table: Mapping[torch._ops.OpOverload, Callable]) -> fx.GraphModule:
    """``node``'s op decomposed by ``table``, traced on its inputs' values (under their fake mode: a
    decomposition may make a constant, nll_loss's zero)."""
    inputs = node.all_input_nodes
    values = [n.meta["val"] for n in inputs]
    mode = next((v.fake_mode for v in values if getattr(v, "fake_mode", None) is not None), None)
    with mode if mode is not None else contextlib.nullcontext():
        return make_fx(_call_with(node, inputs), table, tracing_mode="real")(*values)


def _call_with(node: fx.Node, inputs: list[fx.Node]) -> Callable:
    # Call the op itself under make_fx: the decomposition table then applies (or declines, when a
    # decomposition returns NotImplemented), recursively, as it does for AOTAutograd.
    def call(*values):
        env = dict(zip(inputs, values))
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        return node.target(*args, **kwargs)

    return call


# Ops Inductor lowers (not decomposes) into a reduction written to memory, then a pointwise kernel
# over it: a mean is a sum, then a division (a transformers Llama's RMSNorm: 2,048 B over the plan
# at its smallest budget).
_REDUCED_THEN_SCALED = (torch.ops.aten.mean.dim, torch.ops.aten.mean.default)

# Ops Inductor lowers as a copy of their input written to memory, then changed in place: inside a
# decomposition, their result is a buffer of its own, whatever its size (nll_loss's backward
# scatters into zeros as large as the logits, then scales them into its output: two such buffers
# where eager's kernel writes one; the test-size transformers Llama, 132 B over the plan at 1.0
# with the targets it reads).
_WRITTEN_IN_PLACE = frozenset(("scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put",
                               "index_add", "index_copy", "index_reduce", "masked_scatter",
                               "_unsafe_masked_index_put_accumulate"))


def reduction_scratch(node: fx.Node, table: Mapping[torch._ops.OpOverload, Callable], memo: dict | None = None) -> int:
    """Bytes of the reductions inside the decomposition of ``node``'s op (as `decompose` makes
    it): values smaller than the op's largest input or output that its other pieces read (a
    log-softmax's per-row maximum and sum, a norm's mean and inverse deviation). Inductor fuses an
    op's pointwise pieces and keeps them in registers, but writes such a reduction to memory (a
    transformers GPT-2 at bench size: 6,144 B beyond the simulator's count at its eager peak); the
    eager kernel the simulator measures holds none; a mean, lowered as a sum then a division, holds
    its sum (`_REDUCED_THEN_SCALED`). Besides, the results of the scatters the decomposition makes,
    whatever their size (`_WRITTEN_IN_PLACE`). 0 for an op that is not decomposed. ``memo``:
    answers by op and input metadata."""
    target = node.target
    val = node.meta.get("val")
    if node.op == "call_function" and target in _REDUCED_THEN_SCALED and isinstance(val, torch.Tensor):
        return val.untyped_storage().nbytes()
    if not _decomposable(node, table):
        return 0
    inputs = node.all_input_nodes
    if any(not isinstance(n.meta["val"], torch.Tensor) for n in inputs):
        return 0
    key = (target, str(node.args), str(node.kwargs),
           tuple((tuple(n.meta["val"].shape), tuple(n.meta["val"].stride()), n.meta["val"].dtype) for n in inputs))
    if memo is not None and key in memo:
        return memo[key]
    try:
        sub = _decomposition(node, table)
    except Exception:  # noqa: BLE001 - a decomposition that cannot be traced here: decompose leaves it too
        return 0
    values = [n.meta.get("val") for n in sub.graph.nodes if n.op in ("placeholder", "call_function")]
    largest = max((v.numel() for v in values if isinstance(v, torch.Tensor)), default=0)
    output = next(iter(sub.graph.find_nodes(op="output")))
    total = 0
    for n in (m for m in sub.graph.nodes if m.op == "call_function"):
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and not val._is_view() and n.users and n not in output.all_input_nodes):
            continue
        scatter = isinstance(n.target, torch._ops.OpOverload) and n.target._opname in _WRITTEN_IN_PLACE
        if 0 < val.numel() < largest or scatter:
            total += val.untyped_storage().nbytes()
    if memo is not None:
        memo[key] = total
    return total
