"""Helpers on torch.fx graphs that the analysis and the passes share: which ops alias their input,
which nodes belong to the backward, inserting nodes with their fake values and source metadata."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.fx.traceback
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule

# Ops whose output shares their input's storage without being marked as views.
ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)

# Node meta a rewrite leaves for the analysis: on a copy eager does not make (an identity
# dropout's of a strided input, `fxopt.passes.dropout`), how many copies eager's readers make
# instead; the eager peak counts those (`fxopt.analysis`).
EAGER_COPIES = "fxopt_eager_copies"

_SOURCE_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr", "partitioner_tag")

# The stack trace AOTAutograd gives the ``add`` where autograd's engine sums two gradients of one
# value (None on a torch without it: no such add is then told apart from a formula's own).
_GRADIENT_SUM = getattr(torch.fx.traceback, "GRADIENT_ACC_SPECIAL_STACK", None)


def aliases_input(target) -> bool:
    """Whether the op ``target`` returns a view of (or an alias to) its input: no new storage."""
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in ALIAS_OPS)


class NodeBuilder:
    """Inserts nodes one after another, starting after ``after``; each gets its fake value (the op
    run on its inputs' fake values) and the source metadata of ``meta_from``."""

    def __init__(self, graph: fx.Graph, after: fx.Node, meta_from: fx.Node):
        self.graph, self.anchor, self.meta_from = graph, after, meta_from
        self._fake_mode = None

    @property
    def fake_mode(self):
        if self._fake_mode is None:
            self._fake_mode = detect_fake_mode([self.meta_from.meta["val"]])
        return self._fake_mode

    def __call__(self, op, *args, fake=None, **kwargs) -> fx.Node:
        """``op(*args, **kwargs)`` as the next node. ``fake``: its fake value where the caller
        knows it (an ``out=`` op's is the tensor it writes: not run again under fake tensors)."""
        with self.graph.inserting_after(self.anchor):
            node = self.graph.call_function(op, args, kwargs)
        if fake is None:
            vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            with self.fake_mode:
                fake = op(*vals[0], **vals[1])
        node.meta["val"] = fake
        for key in _SOURCE_META:
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        self.anchor = node
        return node


def accumulates_into(node: fx.Node) -> fx.Node | None:
    """Where ``node`` is a sum of two gradients of one value that autograd's engine makes (the
    ``add`` AOTAutograd traces for it), the operand eager's engine adds the other into in place,
    or None. Eager's engine (``InputBuffer::accumulate``, grad mode off) writes the sum over the
    gradient it holds so far, else over the new one, where it holds the last reference to that
    tensor and its storage and the tensor is dense. Here: the first operand made in the backward
    (a formula's output, not an incoming gradient) that nothing but ``node`` reads, its storage
    read by nothing else either (through views, or an earlier sum written over it), with the
    sum's shape, strides and dtype (a sum's own layout is dense). The same IEEE addition either
    way, so the sum is bit-equal."""
    if (_GRADIENT_SUM is None or node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor
            or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or node.args[0] is node.args[1]
            or _GRADIENT_SUM not in (node.meta.get("stack_trace") or "")
            or not isinstance(out := node.meta.get("val"), torch.Tensor)):
        return None
    return next((a for a in node.args
                 if isinstance(a, fx.Node) and _free_after(a, node) and same_layout(a.meta.get("val"), out)), None)


def _free_after(value: fx.Node, reader: fx.Node) -> bool:
    """Whether ``reader`` is the last use of ``value``'s storage: ``value`` is made in the backward
    and read by ``reader`` alone, and each node it aliases (down the views, and the outputs an
    ``out=`` op wrote over) is made in the backward and read only by the one above it."""
    node, above = value, reader
    while True:
        if (node.op != "call_function" or node.meta.get("partitioner_tag") != "is_backward"
                or set(node.users) != {above}):
            return False
        target = node.target
        if aliases_input(target) and node.args and isinstance(node.args[0], fx.Node):
            node, above = node.args[0], node
        elif isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            written = node.kwargs.get("out")
            if not isinstance(written, fx.Node):
                return False
            node, above = written, node
        else:
            return True


def same_layout(a, b) -> bool:
    """Whether ``a`` and ``b`` are tensors of one shape, strides and dtype, without a guard on a
    symbolic size (a size only equal under a guard counts as different): one may hold the other's
    value (a rewrite in place)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))
            and all(statically_known_true(x == y) for x, y in zip(a.stride(), b.stride())))


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (nodes and their metadata copied), to rewrite one and
    keep the other."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph_module(gm, graph)


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``graph`` as a module whose Python code is generated when first needed (run, or its
    ``.code`` read), not at each `recompile`: torch's `_LazyGraphModule`, as AOTAutograd and
    Inductor make theirs. Planning reads a joint graph's nodes only and rewrites it in place
    (each rewrite recompiles), and at 32 layers generating the code of its 7,600 nodes five
    times took 2.9 s of a profiled answer."""
    return _LazyGraphModule(root, graph)


def tangent_dependents(graph: fx.Graph) -> set[fx.Node]:
    """The incoming gradients (``tangents_*`` placeholders) and every node that depends on one."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if n.name.startswith("tangents"):
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def rewrite_each(gm: fx.GraphModule, target, rewrite: Callable[[fx.Node], bool]) -> int:
    """``rewrite(node)`` on each call of ``target`` in ``gm`` (in place; it answers whether it
    rewrote that one), then the graph checked and recompiled where any was: how many were."""
    count = sum(bool(rewrite(node)) for node in list(gm.graph.find_nodes(op="call_function", target=target)))
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def replace_node(graph: fx.Graph, node: fx.Node, op, *args, fake=None, **kwargs) -> fx.Node:
    """Compute ``op(*args, **kwargs)`` where ``node`` is (with its source metadata), make every
    user of ``node`` read it instead, and erase ``node``. ``fake``: the new node's fake value
    where the caller knows it (`NodeBuilder`)."""
    new = NodeBuilder(graph, node.prev, node)(op, *args, fake=fake, **kwargs)
    replace_value(node, new)
    graph.erase_node(node)
    return new


def replace_value(old: fx.Node, new: fx.Node) -> None:
    """Make every user of ``old`` read ``new`` instead. Views of ``old`` (and views of those) get
    fresh fake values, so that they alias ``new``'s storage: analysis finds aliasing by storage."""
    old.replace_all_uses_with(new)
    fake_mode = detect_fake_mode([new.meta["val"]])
    stack = list(new.users)
    while stack:
        node = stack.pop()
        target = node.target
        if not aliases_input(target):
            continue
        vals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        stack.extend(node.users)


def module_name(path: str) -> str:
    """A node's module path as Dynamo spells it (its ``nn_module_stack``), relative to the module
    compiled: ``L['self'].blocks._modules['0'].l1`` → ``blocks.0.l1``. The root is the frame's first
    argument, whatever its name: ``L['self']``, ``L['args'][0]`` (a forward wrapped by a decorator
    taking ``*args``, as transformers' are), ``L['s']``, ``L__self__``."""
    while "getattr(" in path:  # getattr(L.self.h, '3') -> L.self.h.3
        path = re.sub(r"getattr\(([^(),]+), ['\"]([^'\"]+)['\"]\)", r"\1.\2", path, count=1)
    path = re.sub(r"\._modules\[['\"]([^'\"]*)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = re.sub(r"^(L\.args\.0|L__self__|L\.\w+)(\.|$)", "", path)
    return path.replace("..", ".").strip(".")
