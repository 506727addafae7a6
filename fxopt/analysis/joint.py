"""From an aten-level joint fx graph (AOTAutograd's forward+backward) to the solvers' `Graph`.

Sizes come from each node's fake tensor (``meta["val"]``); aliasing from storage identity (views,
``detach``, ``split`` outputs share their base's storage and cost nothing). Compute cost is counted
FLOPs (``torch.utils.flop_counter``'s formulas) plus memory traffic, turned into estimated seconds
by a `CostModel`. Random ops, ops that mutate or have side effects, and collectives are marked
non-recomputable: random ops must run once, exactly where eager runs them, so that dropout masks
match eager's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxopt.analysis.codecs import Codec, Quantize, codec_workspace, offered_codec
from fxopt.analysis.eager_saves import eager_saves
from fxopt.analysis.costs import GATHERS, WAITS, CostModel, comm_bytes_of, flops_of, group_backend
from fxopt.analysis.scratch import FormulaMemory, OpMemory, lingering_bytes, op_memory, scratch_beyond_output
from fxopt.analysis.symbolic import NodeSizes, Point, Size, Sizes, SymbolicGraph, error_on_new_guards
from fxopt.devices import DeviceProfile
from fxopt.storage import storage_bytes, tensors_in
from fxopt.errors import CaptureError
from fxopt.fxgraph import EAGER_COPIES, accumulates_into, same_layout, tangent_dependents
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.plan import Plan
from fxopt.solvers.policies import repeated_blocks
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """A joint fx graph together with its solver view; ``names[i]`` is the fx node of ``graph.nodes[i]``."""

    module: fx.GraphModule
    graph: Graph
    names: tuple[str, ...]
    num_fwd_outputs: int
    module_paths: tuple[str, ...]  # nn.Module path each node comes from ("" when unknown)
    codecs: dict = dataclasses.field(default_factory=dict)  # node index -> `fxopt.analysis.codecs.Codec`
    # With dynamic shapes: the same graph with its sizes as expressions (``graph`` is it at one
    # shape); None for a static step.
    symbolic: SymbolicGraph | None = None
    # The profile planned for, where it is not the device the step was captured on (see `analyze`).
    device: DeviceProfile | None = None
    # The nodes run in the order `fxopt.passes.reorder` chose, not as captured (`Plan.reordered`).
    reordered: bool = False
    # What an analysis of the same graph after a rewrite in place may read instead of working it
    # out again (`analyze`'s ``earlier``): not part of the analysis' value.
    reusable: Reusable | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fingerprint(self) -> str:
        return graph_fingerprint(self.graph)

    def at(self, point: Point) -> Graph:
        """The solver graph at another shape of a step captured with dynamic shapes, with the
        scratch memory of its ops measured at that shape."""
        symbolic = self.symbolic
        if symbolic is None:
            raise ValueError("a static step has one shape")
        sizes = Sizes(symbolic.names, point, symbolic.ranges)
        fx_nodes, formula = self._ops
        with no_new_guards(fx_nodes):
            memory = op_memory(fx_nodes, sizes.at, self.device, formula)
            measured = measured_storage_bytes(fx_nodes, memory)
            workspace = [scratch_beyond_output(memory[n].increase if n in memory else 0, max(sizes.at_point(s.bytes), m))
                         for n, s, m in zip(fx_nodes, symbolic.sizes, measured)]
            codec = (codec_workspace({i: (fx_nodes[i], c) for i, c in self.codecs.items()}, sizes.at, self.device)
                     if self.codecs else {})
        extra = [0] * (len(symbolic.sizes) - len(fx_nodes))  # the unread resident memory, last
        return symbolic.at(point, workspace + extra, [codec.get(i, 0) for i in range(len(symbolic.sizes))],
                           measured + extra)

    @functools.cached_property
    def _ops(self) -> tuple[list[fx.Node], FormulaMemory | None]:
        """The graph's nodes as `at` reads them, and where the device's scratch is a formula, that
        formula's reading of them (`fxopt.analysis.scratch.FormulaMemory`): found once, for every
        shape `at` is asked for (the graph does not change: ``module`` is the step as analysed)."""
        fx_nodes = [n for n in self.module.graph.nodes if n.op != "output"]
        device = self.device
        return fx_nodes, FormulaMemory(fx_nodes, device) if device is not None and not device.scratch_measured else None


@dataclasses.dataclass(frozen=True)
class Reusable:
    """The parts of an analysis that an analysis of the same fx graph after a rewrite in place
    (the planner's: `fxopt.planner._rewrite_for_planning`) reads where the rewrite left their
    inputs alone (`analyze`'s ``earlier``): the two slowest per-node parts of a large step's
    analysis, which the loss's backward written in place changes in one node of thousands.

    ``settings``: what both parts depend on besides the nodes (the shape and device analysed
    for). ``forward``, ``saves``: what `eager_saves` read (every node it may run, with what it
    reads of it, `_node_read`; the backward formulas; the step's gradients) and what it found.
    ``memory``: for each node, what `op_memory` read of it and found (None: not measurable)."""

    settings: tuple
    forward: tuple
    saves: dict
    memory: dict


def _reusable(earlier: JointGraph | None, sizes: Sizes | None, device) -> tuple[Reusable | None, tuple]:
    """``earlier``'s `Reusable` where it was analysed at the same ``sizes`` and ``device`` (else
    None), and those settings."""
    settings = (sizes, device)
    reuse = None if earlier is None else earlier.reusable
    return (reuse if reuse is not None and reuse.settings == settings else None), settings


def _node_read(n: fx.Node) -> tuple:
    """What a node's own per-node analysis reads of it: its op, its arguments (fx keeps them in
    one tuple and one dict, replaced where a rewrite changes them: a node whose uses a rewrite
    moved has new ones), and the fake values of it and of its inputs (a rewrite in place gives a
    view of a rewritten value a new one, its arguments unchanged). All compared by identity
    (`_same_read`): no argument is compared by value (a size may be symbolic)."""
    return (n.target, n.args, n.kwargs, n.meta.get("val"), *(a.meta.get("val") for a in n.all_input_nodes))


def _same_read(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _eager_saves_read(fx_nodes: list[fx.Node], backward: set[fx.Node], gradients: list) -> tuple:
    """What `eager_saves` reads of the step: the nodes it may run (not the backward's), the
    backward formulas (their autograd numbers) and which primals get a gradient (not the nodes
    that make them: a rewrite of the backward may make one anew, `fxopt.passes.accumulate`)."""
    forward = tuple((n, _node_read(n)) for n in fx_nodes if n not in backward)
    formulas = frozenset(n.meta.get("seq_nr") for n in backward
                         if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_backward")
    return forward, formulas, tuple(g is not None for g in gradients)


def _same_saves_read(a: tuple, b: tuple) -> bool:
    (forward_a, formulas_a, grads_a), (forward_b, formulas_b, grads_b) = a, b
    return (formulas_a == formulas_b and grads_a == grads_b and len(forward_a) == len(forward_b)
            and all(m is n and _same_read(r, q) for (m, r), (n, q) in zip(forward_a, forward_b)))


def _saves(fx_nodes: list[fx.Node], backward: set[fx.Node], gradients: list, earlier: Reusable | None):
    """`eager_saves`, or ``earlier``'s where it read the same: (what it read, what it found)."""
    read = _eager_saves_read(fx_nodes, backward, gradients)
    if earlier is not None and _same_saves_read(earlier.forward, read):
        return read, earlier.saves
    return read, eager_saves(fx_nodes, backward, gradients)


def _op_memory(fx_nodes: list[fx.Node], sizes: Sizes, device, earlier: Reusable | None):
    """`op_memory` of ``fx_nodes``, each node ``earlier`` found reading the same (`_node_read`)
    read from it (`op_memory` finds each node's alone); and for each node, (what it read, what
    was found: None where not measurable), to reuse in turn."""
    found, todo = {}, []
    for n in fx_nodes:
        known = earlier.memory.get(n) if earlier is not None else None
        if known is not None and _same_read(known[0], _node_read(n)):
            found[n] = known
        else:
            todo.append(n)
    measured = op_memory(todo, sizes.at, device) if todo else {}
    found.update((n, (_node_read(n), measured.get(n))) for n in todo)
    return {n: m for n, (_, m) in found.items() if m is not None}, found


def graph_fingerprint(graph: Graph) -> str:
    payload = [(n.name, n.kind, n.inputs, n.bytes, n.storage, n.recomputable, n.output, n.codec, n.compressed_bytes)
               for n in graph.nodes]
    if graph.transfers is not None:  # (only then: fingerprints of graphs without OFFLOAD are unchanged)
        payload.append(graph.transfers.to_dict())
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


_UNCOUNTED = object()


def _is_recomputable(node: fx.Node, flops=_UNCOUNTED) -> bool:
    """``flops``: `flops_of` the node, where counted already (else counted here)."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # higher-order ops and Python callables: keep them where they are
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target._schema.is_mutable:
        return False
    if target.namespace == "_c10d_functional" and _is_gather(node):
        return True  # a re-gather: the all-gather again (priced as communication), and its wait
    if target.namespace in ("_c10d_functional", "c10d_functional", "_dtensor", "profiler"):
        return False
    # (An op whose cost cannot be counted is never recomputed.)
    return (flops_of(node) if flops is _UNCOUNTED else flops) is not None


def _is_gather(node: fx.Node) -> bool:
    """An all-gather of the functional collectives, or the wait for one: recomputing them gathers
    a sharded parameter again (every rank runs the same plan, so they gather in the same order)."""
    name = node.target._opname
    if name in GATHERS:
        return True
    source = node.args[0] if node.args else None
    return (name in WAITS and isinstance(source, fx.Node) and isinstance(source.target, torch._ops.OpOverload)
            and source.target.namespace == "_c10d_functional" and source.target._opname in GATHERS)


# The op classes the simple policies name (`fxopt.solvers.policies`), by aten op: what torch's
# selective checkpointing saves (torchtitan's op list: matrix products and attention kernels),
# and convolutions (the partitioner's other compute-intensive ops).
_OP_CLASSES = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "_int_mm"), "matmul"),
    **dict.fromkeys(("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math",
                     "scaled_dot_product_attention", "_efficient_attention_forward", "_flash_attention_forward"),
                    "attention"),
    **dict.fromkeys(("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                     "conv_transpose2d", "conv_transpose3d"), "convolution"),
}


def _op_class(node: fx.Node) -> str:
    """"matmul", "attention", "convolution", "pointwise" (`_is_pointwise`) or "" (an output taken
    out of a tuple: its op's)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _op_class(node.args[0])
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return ""
    return _OP_CLASSES.get(target.overloadpacket.__name__) or ("pointwise" if _is_pointwise(node) else "")


def _is_pointwise(node: fx.Node) -> bool:
    """An op each element of whose output is a function of the same element of its inputs, which
    a compiler fuses into the kernel that reads it (`CostModel.fused_pointwise`): aten's own
    ``pointwise`` tag, and a dtype cast that stays on its device (``_to_copy``, untagged)."""
    target = node.target
    if torch.Tag.pointwise in target.tags:
        return True
    if target is not torch.ops.aten._to_copy.default or not isinstance(node.args[0], fx.Node):
        return False
    val, source = node.meta.get("val"), node.args[0].meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(source, torch.Tensor) and val.device == source.device


def _module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """The modules ``node`` runs inside, as (path, class name), outermost first."""
    out = []
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        path, cls = entry if isinstance(entry, tuple) else (str(entry), "")
        out.append((str(path), f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)))
    return out


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


def _check_constant(joint: fx.GraphModule, node: fx.Node) -> None:
    """A tensor constant (``get_attr``: a tensor built in forward() from Python values, a lifted
    constant) is a resident value like a parameter: sized, kept, never recomputed, read by the
    forward and the backward where they need it. Anything else held as an attribute is refused."""
    value = getattr(joint, node.target, None)
    if not isinstance(value, torch.Tensor):
        raise CaptureError(
            f"unsupported constant {node.target!r} ({type(value).__name__}) in the captured step: fxopt "
            "handles tensor constants only. Build it outside forward() or pass it as an argument."
        )
    if "val" not in node.meta:
        fake_mode = next((m.meta["val"].fake_mode for m in joint.graph.nodes
                          if isinstance(m.meta.get("val"), torch._subclasses.FakeTensor)), None)
        node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True) if fake_mode is not None else value


# The name of the input node standing for resident memory the step does not read.
UNREAD_RESIDENT = "<resident, not read by the step>"
# The name of the tangent node standing for memory held beside the step's backward only.
HELD_IN_BACKWARD = "<held beside the backward>"


def unread_resident(nbytes: int) -> Node:
    """The input node, last in the graph, that counts ``nbytes`` of resident memory no graph
    input shows (`analyze`'s ``unread_resident_bytes``)."""
    return Node(name=UNREAD_RESIDENT, kind="input", bytes=nbytes, recomputable=False)


def with_unread_resident(plan: Plan, extra_bytes: int) -> Plan:
    """``plan`` for the same step captured with ``extra_bytes`` more memory resident that it does
    not read: the same schedule, with the graph, eager peak and fingerprint that capture gives."""
    nodes, paths = list(plan.graph.nodes), list(plan.module_paths)
    if nodes and nodes[-1].name == UNREAD_RESIDENT:
        nodes[-1] = dataclasses.replace(nodes[-1], bytes=nodes[-1].bytes + extra_bytes)
    else:
        nodes.append(unread_resident(extra_bytes))
        paths.append("")
    graph = Graph(tuple(nodes), plan.graph.transfers)
    return Plan.build(graph=graph, schedule=plan.schedule, budget_bytes=plan.budget_bytes,
                      eager_peak_bytes=plan.eager_peak_bytes + extra_bytes, solver=plan.solver, status=plan.status,
                      solve_seconds=plan.solve_seconds, fingerprint=graph_fingerprint(graph),
                      module_paths=tuple(paths) if plan.module_paths else (), lower_bound_cost=plan.lower_bound_cost,
                      reordered=plan.reordered)


def analyze(joint: fx.GraphModule, num_fwd_outputs: int, cost_model: CostModel | None = None, *,
            compress: bool = True, quantize: Quantize | None = None,
            unread_resident_bytes: int = 0, sizes: Sizes | None = None,
            device: DeviceProfile | None = None, backward_held_bytes: int = 0,
            whole_step: bool = False, earlier: JointGraph | None = None) -> JointGraph:
    """The solver's view of ``joint``. ``compress``: offer lossless codecs (packed bits for bool
    tensors, int32 for max-pooling indices); ``quantize``: offer this lossy codec for floating-point
    activations (see `fxopt.analysis.codecs`). ``unread_resident_bytes``: memory alive through the
    step that no graph input shows (a module's parameters and buffers the step never reads, such
    as Llama's ``original_inv_freq``); the graph gets one more input node of that size, last, so
    that every peak counts it as the measured peak does. ``sizes``: how to read the sizes of a
    step captured with dynamic shapes (`fxopt.analysis.symbolic.Sizes`): the graph is the step at
    ``sizes.point``, and `JointGraph.symbolic` keeps every size as an expression. ``device``: the
    profile (`fxopt.devices`) the step is planned for where it was captured on fake tensors of
    the host: every storage counted as its allocator holds it (rounded to its blocks), the cuBLAS
    workspace resident through the step where a matrix product runs, the ops' scratch its
    (`fxopt.analysis.scratch.op_memory`). ``backward_held_bytes``: memory alive beside the step's
    backward only (a step in pieces: the gradients later pieces' backwards made first, see
    `fxopt.capture.pieces`); the graph gets one more tangent node of that size, last, which every
    peak holds from the backward's start to its end. ``whole_step``: the graph is a whole training
    step (not a piece of one, whose outputs later pieces differentiate), whose caller starts the
    backward at its scalar loss: its other outputs get no gradient in eager's step
    (`_without_gradients_eager_never_makes`). ``earlier``: ``joint`` before a rewrite (`Reusable`)."""
    cost_model = cost_model or CostModel()
    reuse, settings = _reusable(earlier, sizes, device)
    sizes = sizes or Sizes()
    fx_nodes = [n for n in joint.graph.nodes if n.op != "output"]
    gathers = [n for n in fx_nodes if n.op == "call_function" and comm_bytes_of(n)]
    if gathers:  # communication priced at the rate of the group the step gathers over
        cost_model = cost_model.for_group(group_backend(gathers[0]))
    with no_new_guards(fx_nodes):
        _check_inputs(joint, fx_nodes)
        outs = list(next(iter(joint.graph.find_nodes(op="output"))).args[0])
        fwd_outs = {o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)}
        bwd_outs = {o for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node)}
        backward = _backward_nodes(joint.graph, fx_nodes, fwd_outs, bwd_outs)
        on_cpu = device is None or device.kind == "cpu"  # (eager's dropout where the step runs: see below)
        nodes, node_sizes, codecs = _values(fx_nodes, backward, fwd_outs | bwd_outs, sizes, compress, quantize, on_cpu)
        read, saves = _saves(fx_nodes, backward, outs[num_fwd_outputs:], reuse)
        nodes = _with_eager_reads(nodes, fx_nodes, saves)
        nodes = _with_eager_in_place(nodes, fx_nodes)
        if whole_step:
            nodes = _without_gradients_eager_never_makes(nodes, fx_nodes)
        memory, per_node = _op_memory(fx_nodes, sizes, device, reuse)
        measured = measured_storage_bytes(fx_nodes, memory)
        at = sizes.at_point
        workspace = [scratch_beyond_output(memory[n].increase if n in memory else 0, max(at(s.bytes), m))
                     for n, s, m in zip(fx_nodes, node_sizes, measured)]
        lingers = [lingering_bytes(n, sizes.at) for n in fx_nodes]
        coding = codec_workspace({i: (fx_nodes[i], c) for i, c in codecs.items()}, sizes.at, device) if codecs else {}
    names = [n.name for n in fx_nodes]
    module_paths = [_module_path(n) for n in fx_nodes]
    blocks = repeated_blocks([_module_stack(n) for n in fx_nodes])
    # (one copy of each node with all it learnt here: a copy per field is most of this loop's time)
    nodes = [dataclasses.replace(node, workspace=workspace[i], lingers=lingers[i], codec_workspace=coding.get(i, 0),
                                 blocks=blocks[i], op_class=_op_class(n))
             for i, (node, n) in enumerate(zip(nodes, fx_nodes))]
    if device is not None and any(n.op_class == "matmul" for n in nodes):
        # (held from the first matrix product on: counted from the step's start, a bound)
        unread_resident_bytes += device.cublas_workspace_bytes
    if unread_resident_bytes > 0:
        nodes.append(unread_resident(unread_resident_bytes))
        node_sizes.append(NodeSizes(bytes=unread_resident_bytes))
        measured.append(0)
        names.append(UNREAD_RESIDENT)
        module_paths.append("")
    if backward_held_bytes > 0:
        # An incoming gradient nothing reads: the solvers and the simulator hold it from the start
        # of the backward to its end, as the autograd engine holds tangents.
        nodes.append(Node(name=HELD_IN_BACKWARD, kind="input", bytes=backward_held_bytes, recomputable=False,
                          tangent=True))
        node_sizes.append(NodeSizes(bytes=backward_held_bytes))
        measured.append(0)
        names.append(HELD_IN_BACKWARD)
        module_paths.append("")
    symbolic = SymbolicGraph(Graph(tuple(nodes)), tuple(node_sizes), sizes.ranges, sizes.point, cost_model, sizes.names,
                             tuple(measured), round_bytes=1 if device is None else device.round_bytes)
    return JointGraph(module=joint, graph=symbolic.at(sizes.point), names=tuple(names), num_fwd_outputs=num_fwd_outputs,
                      module_paths=tuple(module_paths), codecs=codecs, symbolic=symbolic if sizes.symbolic else None,
                      device=device, reusable=Reusable(settings, read, saves, per_node))


def measured_storage_bytes(fx_nodes: list[fx.Node], memory: dict[fx.Node, OpMemory]) -> list[int]:
    """For each value that owns its storage, the bytes the real kernel allocated for it where its
    op was measured (`OpMemory.output_bytes`), else 0: a floor under the fake tensor's bytes. An
    output taken out of a tuple by ``getitem`` owns that item's storage; the tuple, the items none
    takes. (A view owns nothing: 0.)"""
    out = []
    for n in fx_nodes:
        val = n.meta.get("val")
        source = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else None
        if source is not None and source in memory and isinstance(n.args[1], int):
            items = memory[source].output_bytes
            out.append(items[n.args[1]] if n.args[1] < len(items) else 0)
        elif n in memory and isinstance(val, torch.Tensor):
            out.append(sum(memory[n].output_bytes))
        elif n in memory:
            taken = {u.args[1] for u in n.users if u.target is operator.getitem}
            out.append(sum(b for k, b in enumerate(memory[n].output_bytes) if k not in taken))
        else:
            out.append(0)
    return out


def _values(fx_nodes: list[fx.Node], backward: set[fx.Node], outputs: set[fx.Node], sizes: Sizes,
            compress: bool, quantize: Quantize | None, on_cpu: bool = True
            ) -> tuple[list[Node], list[NodeSizes], dict[int, Codec]]:
    """One solver node per fx node (its sizes filled in later, at a shape), its sizes as
    expressions, and the codec offered to each value that has one. ``on_cpu``: the step runs on
    the host (its fake tensors may be the host's for a CUDA profile, whose eager dropout is not)."""
    index = {n: i for i, n in enumerate(fx_nodes)}
    # AOTAutograd numbers autograd nodes with a counter of the process: number the formulas by
    # first appearance instead, so that the same step gets the same graph (and plan cache key).
    formulas: dict[int, int] = {}
    storage_owner: dict[StorageWeakRef, int] = {}
    nodes: list[Node] = []
    node_sizes: list[NodeSizes] = []
    codecs: dict[int, Codec] = {}
    for i, n in enumerate(fx_nodes):
        storage, own_bytes = _storage_of(n, i, storage_owner, sizes)
        val = n.meta.get("val")
        # A size (a SymInt the forward computes) is known wherever the step runs: an input.
        is_size = isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)) and n not in backward
        if n.op in ("placeholder", "get_attr") or is_size:
            kind = "input"
        elif n in backward:
            kind = "backward"
        else:
            kind = "forward"
        counted = flops_of(n) if n.op == "call_function" else 0  # (once: a symbolic step's formulas are slow)
        recomputable = n.op == "call_function" and not is_size and _is_recomputable(n, counted)
        if n.target is operator.getitem and not nodes[index[n.args[0]]].recomputable:
            recomputable = False  # an output taken out of a tuple is recomputed with the op that made it
        flops = sizes.expr(counted or 0) if n.op == "call_function" else 0
        moved = own_bytes + sum(
            sizes.expr(storage_bytes(t)) for a in n.all_input_nodes for t in tensors_in(a.meta.get("val"))
        ) if n.op == "call_function" and storage is None else 0
        codec = offered_codec(n, compress=compress, quantize=quantize) if kind == "forward" and storage is None else None
        if codec is not None:
            codecs[i] = codec
        node_sizes.append(NodeSizes(
            bytes=own_bytes, moved=moved, flops=flops,
            compressed_bytes=0 if codec is None else sizes.expr(codec.compressed_bytes),
            codec_flops=0 if codec is None else sizes.expr(codec.elementwise_flops(val.numel())),
            comm=comm_bytes_of(n) if n.op == "call_function" else 0))
        nodes.append(Node(
            name=n.name,
            kind=kind,
            inputs=() if is_size else tuple(index[a] for a in n.all_input_nodes),
            storage=storage,
            recomputable=recomputable,
            output=n in outputs,
            tangent=n.op == "placeholder" and n.name.startswith("tangents"),
            tensor=isinstance(val, torch.Tensor),
            codec=None if codec is None else codec.name,
            backward_formula=None if (f := _backward_formula(n)) is None else formulas.setdefault(f, len(formulas)),
            python_formula=f is not None and n.meta.get("partitioner_tag") != "is_backward",
            eager_number_bytes=_wrapped_number_bytes(n) if kind == "forward" else 0,
            eager_bytes=(_eager_dropout_mask_bytes(n) if on_cpu else None) if EAGER_COPIES not in n.meta
            else _eager_copies_bytes(n),
        ))
    return nodes, node_sizes, codecs


def _with_eager_reads(nodes: list[Node], fx_nodes: list[fx.Node], saves: dict[int, list[fx.Node]]) -> list[Node]:
    """``nodes`` with what each autograd node saves in eager (`fxopt.analysis.eager_saves`) as
    `Node.eager_reads` of its formula's first node after the value (what that node reads
    already left out)."""
    index = {n: i for i, n in enumerate(fx_nodes)}
    formula: dict[int, list[int]] = {}
    for i, n in enumerate(fx_nodes):
        if nodes[i].kind == "backward" and not nodes[i].python_formula and (seq_nr := _backward_formula(n)) is not None:
            formula.setdefault(seq_nr, []).append(i)
    reads: dict[int, list[int]] = {}
    for seq_nr, saved in saves.items():
        for j in dict.fromkeys(index[a] for a in saved):
            # (on the formula's first node after the value: a graph may place a forward value late)
            i = next((i for i in formula.get(seq_nr, ()) if i > j), None)
            if i is not None and j not in nodes[i].inputs:
                reads.setdefault(i, []).append(j)
    return [dataclasses.replace(node, eager_reads=tuple(reads[i])) if i in reads else node
            for i, node in enumerate(nodes)]


# The functional ops functionalization writes an in-place mutation as (``x.slice(...).copy_(g)``:
# ``slice_scatter(x, g, ...)``; ``x.scatter_add_(...)``: ``scatter_add``): eager's formulas write in place.
_FUNCTIONALIZED_IN_PLACE = frozenset([
    aten.slice_scatter.default, aten.select_scatter.default, aten.diagonal_scatter.default,
    aten.as_strided_scatter.default, aten.scatter_add.default, aten.scatter.src, aten.scatter.value,
    aten.index_put.default, aten.index_add.default, aten.masked_scatter.default, aten.copy.default,
])


def _storage_root(nodes: list[Node], i: int) -> int:
    """The node whose storage node ``i`` lives in (`Graph.root`, on a list of nodes being built)."""
    s = nodes[i].storage
    return i if s is None or s == i else _storage_root(nodes, s)


def _with_eager_in_place(nodes: list[Node], fx_nodes: list[fx.Node]) -> list[Node]:
    """``nodes`` with `Node.eager_in_place` where an aten formula's in-place write became a
    functional op (`_FUNCTIONALIZED_IN_PLACE`) on a buffer the same formula made, and where
    autograd's engine sums two gradients of one value over the first of them
    (`fxopt.fxgraph.accumulates_into`; where only the second is free, eager writes over that one,
    which is counted here as a new buffer: above eager, never below)."""
    index = {n: i for i, n in enumerate(fx_nodes)}

    out = list(nodes)
    for i, n in enumerate(fx_nodes):
        if n.target is aten.add.Tensor and (into := accumulates_into(n)) is not None and into is n.args[0]:
            out[i] = dataclasses.replace(out[i], eager_in_place=True)
            continue
        if n.target not in _FUNCTIONALIZED_IN_PLACE or n.meta.get("partitioner_tag") != "is_backward":
            continue
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        base = fx_nodes[_storage_root(nodes, index[first])] if first is not None else None
        if (base is not None and base.meta.get("partitioner_tag") == "is_backward"
                and base.meta.get("seq_nr") == n.meta.get("seq_nr") and isinstance(n.meta.get("val"), torch.Tensor)):
            out[i] = dataclasses.replace(out[i], eager_in_place=True)
    return out


def _without_gradients_eager_never_makes(nodes: list[Node], fx_nodes: list[fx.Node]) -> list[Node]:
    """``nodes`` as eager runs a step that returns its scalar loss beside other values needing a
    gradient (a transformers LM given labels returns the logits too), whose backward the user
    starts at the loss (``loss.backward()``). The step is traced with an incoming gradient for each
    output; eager gets none for the non-scalar ones, so in the eager step's memory
    (`fxopt.solvers.eager_timeline`) those tangents hold nothing (`Node.eager_bytes`), and where the
    traced backward adds one to a gradient the loss's backward made (the logits' gradient), eager's
    value is that gradient itself (`Node.eager_in_place`, on the operand eager makes). fxopt's own
    step and its plan keep them: a user may also start the backward at those outputs. Only where a
    scalar tangent (the loss's) is there: a step of non-scalar outputs has every gradient given."""
    tangents = [i for i, n in enumerate(fx_nodes) if n.op == "placeholder" and n.name.startswith("tangents")
                and isinstance(n.meta.get("val"), torch.Tensor)]
    if not any(fx_nodes[i].meta["val"].dim() == 0 for i in tangents):
        return nodes
    never = {i for i in tangents if fx_nodes[i].meta["val"].dim() > 0}
    index = {n: i for i, n in enumerate(fx_nodes)}

    out = [dataclasses.replace(node, eager_bytes=0) if i in never else node for i, node in enumerate(nodes)]
    for i, n in enumerate(fx_nodes):
        if n.target is not aten.add.Tensor or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 2:
            continue
        operands = [a for a in n.args if isinstance(a, fx.Node)]
        made = [a for a in operands if _storage_root(nodes, index[a]) not in never]
        if len(operands) != 2 or len(made) != 1 or not same_layout(made[0].meta.get("val"), n.meta.get("val")):
            continue
        out[i] = dataclasses.replace(out[i], eager_in_place=True)
    return out


def _backward_formula(n: fx.Node) -> int | None:
    """The eager backward formula ``n`` is part of (see `Node.backward_formula`): AOTAutograd tags
    every node it traced in the forward ``is_forward``, and what it traced in the backward
    ``is_backward`` (or nothing: the backward of a custom ``autograd.Function``, Bloom's GELU),
    each with the sequence number of the autograd node whose formula it ran in. A node a rewrite
    added has no sequence number."""
    seq_nr = n.meta.get("seq_nr")
    if n.op != "call_function" or n.meta.get("partitioner_tag") == "is_forward" or not isinstance(seq_nr, int):
        return None
    return seq_nr


# What eager wraps each kind of Python number in: a 0-dim float64, int64, bool or complex128 tensor.
_WRAPPED_BYTES = {bool: 1, int: 8, float: 8, complex: 16}


def _wrapped_number_bytes(n: fx.Node) -> int:
    """Bytes of the tensors eager makes of the Python numbers ``n``'s op takes as tensors (see
    `Node.eager_number_bytes`)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return 0
    given = dict(zip((a.name for a in n.target._schema.arguments), n.args)) | dict(n.kwargs)
    total = 0
    for arg in n.target._schema.arguments:
        value = given.get(arg.name)
        if isinstance(arg.type, torch.TensorType) and type(value) in _WRAPPED_BYTES:
            total += _WRAPPED_BYTES[type(value)]
    return total


def _eager_dropout_mask_bytes(n: fx.Node) -> int | None:
    """For the mask ``native_dropout`` returns on CPU: its bytes in eager, where ``at::dropout``
    does not run that kernel but multiplies its input by a noise tensor of the input's dtype,
    which autograd keeps (see `Node.eager_bytes`); None for anything else."""
    source = n.args[0] if n.target is operator.getitem and n.args[1] == 1 else None
    if not isinstance(source, fx.Node) or source.target is not aten.native_dropout.default:
        return None
    mask, x = n.meta.get("val"), source.args[0].meta.get("val")
    if not isinstance(mask, torch.Tensor) or not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return None
    numel = mask.numel()
    return numel * x.element_size() if isinstance(numel, int) else None  # (a symbolic size: not counted)


def _eager_copies_bytes(n: fx.Node) -> int | None:
    """For a copy eager does not make (`fxopt.fxgraph.EAGER_COPIES`): the bytes of the copies its
    readers make in eager instead, each alive, at most, as long as this one (None: a symbolic size)."""
    val = n.meta.get("val")
    numel = val.numel() if isinstance(val, torch.Tensor) else None
    return n.meta[EAGER_COPIES] * numel * val.element_size() if isinstance(numel, int) else None


def no_new_guards(fx_nodes: list[fx.Node]):
    """While fxopt reads a symbolic step, no decision of its own may depend on a size: a guard it
    made would narrow the shapes the compiled step accepts. Dynamo raises if one is attempted."""
    for n in fx_nodes:
        for t in tensors_in(n.meta.get("val")):
            shape_env = getattr(getattr(t, "fake_mode", None), "shape_env", None)
            if shape_env is not None and any(isinstance(s, torch.SymInt) for s in t.shape):
                return error_on_new_guards(shape_env)
    return contextlib.nullcontext()


def _check_inputs(joint: fx.GraphModule, fx_nodes: list[fx.Node]) -> None:
    """Refuse what fxopt cannot plan: unknown graph inputs, non-tensor constants."""
    for n in fx_nodes:
        if n.op == "placeholder" and not (n.name.startswith("primals") or n.name.startswith("tangents")):
            raise CaptureError(
                f"unsupported input {n.name!r} of the captured step: fxopt handles parameters, buffers, "
                "tensor inputs and incoming gradients. Pass it as a tensor argument of forward() or "
                "register it on the module (register_buffer)."
            )
        if n.op == "get_attr":
            _check_constant(joint, n)


def _backward_nodes(graph: fx.Graph, fx_nodes: list[fx.Node], fwd_outs: set[fx.Node],
                    bwd_outs: set[fx.Node]) -> set[fx.Node]:
    """Backward values: those that depend on a tangent, gradients the forward does not need, and
    constants AOTAutograd tagged as backward that only backward values read (one that a forward
    value reads, a view the backward needs, is made in the forward: else recomputing what reads
    it would need a value the backward has not made yet)."""
    depends_on_tangent = tangent_dependents(graph)
    forward_needed: set[fx.Node] = set()
    stack = list(fwd_outs)
    while stack:
        n = stack.pop()
        if n not in forward_needed:
            forward_needed.add(n)
            stack.extend(n.all_input_nodes)
    backward = {n for n in fx_nodes if n.op != "placeholder" and n in depends_on_tangent}
    backward |= {n for n in bwd_outs if n.op != "placeholder" and n not in forward_needed}
    backward |= {
        n for n in fx_nodes
        if n.op == "call_function" and not n.all_input_nodes and n.meta.get("partitioner_tag") == "is_backward"
        and all(u in backward or u.op == "output" for u in n.users)
    }
    return backward


def _waited_on(n: fx.Node) -> torch.Tensor | None:
    """The fake value a functional collective's ``wait_tensor`` waits on (and returns), or None
    for any other node."""
    target = n.target
    if (n.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
            or target.namespace != "_c10d_functional" or target._opname not in WAITS or not n.args):
        return None
    source = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    return source if isinstance(source, torch.Tensor) else None


def _storage_of(n: fx.Node, i: int, storage_owner: dict[StorageWeakRef, int], sizes: Sizes) -> tuple[int | None, Size]:
    """(the node owning the storage ``n``'s value aliases, or None; the bytes ``n`` owns), with
    ``storage_owner`` (storage -> owning node index) updated for a new storage."""
    val = n.meta.get("val")
    tensors = tensors_in(val)
    if isinstance(val, torch.Tensor):
        ref = StorageWeakRef(val.untyped_storage())
        if ref in storage_owner:
            return storage_owner[ref], 0
        waited = _waited_on(n)
        if waited is not None and StorageWeakRef(waited.untyped_storage()) in storage_owner:
            # A collective's wait returns the tensor it waits on (its fake value is a new one).
            storage_owner[ref] = storage_owner[StorageWeakRef(waited.untyped_storage())]
            return storage_owner[ref], 0
        storage_owner[ref] = i
        return None, sizes.expr(storage_bytes(val))
    owners = {storage_owner.get(StorageWeakRef(t.untyped_storage())) for t in tensors}
    if tensors and None not in owners and len(owners) == 1:
        # A tuple of views (split, unbind, chunk): while the tuple lives, so does their base.
        return owners.pop(), 0
    # Outputs taken out by getitem are owned by the getitem; the rest die with the tuple.
    taken = {u.args[1] for u in n.users if u.target is operator.getitem}
    items = val if isinstance(val, (list, tuple)) else []
    own = sum(sizes.expr(storage_bytes(t)) for k, t in enumerate(items)
              if isinstance(t, torch.Tensor) and k not in taken and StorageWeakRef(t.untyped_storage()) not in storage_owner)
    return None, own
