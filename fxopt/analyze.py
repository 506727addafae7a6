"""From an aten-level joint fx graph (AOTAutograd's forward+backward) to the solvers' `Graph`.

Sizes come from each node's fake tensor (``meta["val"]``); aliasing from storage identity (views,
``detach``, ``split`` outputs share their base's storage and cost nothing). Compute cost is counted
FLOPs (``torch.utils.flop_counter``'s formulas) plus memory traffic, turned into estimated seconds
by a `CostModel`. Random ops, ops that mutate or have side effects, and collectives are marked
non-recomputable: random ops must run once, exactly where eager runs them, so that dropout masks
match eager's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

import logging

from fxopt.compression import Codec, Quantize, codec_for
from fxopt.errors import CaptureError
from fxopt.passes._fx import NodeBuilder, tangent_dependents
from fxopt.scratch import op_increases
from fxopt.solvers.graph import Graph, Node

log = logging.getLogger("fxopt")
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one node: FLOPs / ``flops_per_second`` + bytes read and written /
    ``bytes_per_second`` + ``op_overhead`` seconds. Only ratios matter to the solvers. The
    defaults are a rough 2-core CPU; on GPU the same ratios order plans sensibly."""

    flops_per_second: float = 1e11
    bytes_per_second: float = 1e10
    op_overhead: float = 2e-6

    def seconds(self, flops: int, bytes_moved: int, is_alias: bool) -> float:
        if is_alias:
            return self.op_overhead / 10
        return flops / self.flops_per_second + bytes_moved / self.bytes_per_second + self.op_overhead


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """A joint fx graph together with its solver view; ``names[i]`` is the fx node of ``graph.nodes[i]``."""

    module: fx.GraphModule
    graph: Graph
    names: tuple[str, ...]
    num_fwd_outputs: int
    module_paths: tuple[str, ...]  # nn.Module path each node comes from ("" when unknown)
    codecs: dict = dataclasses.field(default_factory=dict)  # node index -> `fxopt.compression.Codec`

    @property
    def fingerprint(self) -> str:
        return graph_fingerprint(self.graph)


def graph_fingerprint(graph: Graph) -> str:
    payload = [(n.name, n.kind, n.inputs, n.bytes, n.storage, n.recomputable, n.output, n.codec, n.compressed_bytes)
               for n in graph.nodes]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): use their elements
        return t.numel() * t.element_size()


def _is_recomputable(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # higher-order ops and Python callables: keep them where they are
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target._schema.is_mutable:
        return False
    if target.namespace in ("_c10d_functional", "c10d_functional", "_dtensor", "profiler"):
        return False
    return True


def _flops(node: fx.Node) -> int:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that does not fit these arguments: count none
        return 0


# The same op can take a few hundred bytes more in the step than alone (allocator and library
# bookkeeping); a small margin on measured scratch keeps the prediction an upper bound.
_SCRATCH_MARGIN = 4096


def _scratch(increase: int, own_bytes: int) -> int:
    """Bytes an op holds while it runs beyond its own storage. For a multi-output op that includes
    the outputs taken out by the getitems that follow it: they are allocated with the op."""
    extra = increase - own_bytes
    return extra + _SCRATCH_MARGIN if extra > 0 else 0


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


def _codec_workspace(todo: dict[int, tuple[fx.Node, Codec]]) -> dict[int, int]:
    """Measured scratch bytes of encoding and decoding each value (the larger), beyond the value
    and its encoding: the codec ops run on made-up tensors like any op (`fxopt.scratch`)."""
    graph = fx.Graph()
    pairs = {}
    for i, (node, codec) in todo.items():
        value = graph.placeholder(f"v{i}")
        value.meta["val"] = node.meta["val"]
        add = NodeBuilder(graph, value, value)
        enc = add(codec.compress_op, value, *codec.compress_args)
        dec = add(codec.decompress_op, enc, *codec.decompress_args)
        pairs[i] = (enc, dec, codec)
    increases = op_increases(list(graph.nodes))
    out = {}
    for i, (enc, dec, codec) in pairs.items():
        value_bytes = _nbytes(todo[i][0].meta["val"])
        extra = max(increases.get(enc, 0) - codec.compressed_bytes, increases.get(dec, 0) - value_bytes, 0)
        out[i] = extra + _SCRATCH_MARGIN if extra else 0
    return out


# Values not offered to lossy codecs: quantization error in them is amplified by the backward.
# A log-probability's error becomes a relative error of its exp (int8 steps of log-probs spanning
# [-10, 0] are 8% errors); a softmax's small probabilities round to 0 under a group's absmax
# scale; a normalisation's backward re-standardises its input with the saved, exact statistics.
_LOSSY_UNSAFE_PRODUCERS = {aten._log_softmax.default, aten._softmax.default, aten.log_softmax.int,
                           aten.softmax.int}
_LOSSY_UNSAFE_READERS = {aten.native_batch_norm_backward.default, aten.native_group_norm_backward.default}


def _quantizable(n: fx.Node) -> bool:
    target = n.target
    if target in _LOSSY_UNSAFE_PRODUCERS or getattr(target, "__name__", "").startswith("_safe_softmax"):
        return False
    stack, seen = [n], set()
    while stack:  # readers of the value or of views of it
        v = stack.pop()
        for u in v.users:
            if u in seen:
                continue
            seen.add(u)
            t = u.target
            if t in _LOSSY_UNSAFE_READERS or getattr(t, "__name__", "").startswith("cudnn_batch_norm_backward"):
                return False
            if isinstance(t, torch._ops.OpOverload) and (t.is_view or t in (aten.detach.default, aten.alias.default)):
                stack.append(u)
    return True


def _is_pool_indices(n: fx.Node) -> bool:
    if n.target is not operator.getitem or n.args[1] != 1:
        return False
    src = n.args[0]
    return isinstance(src, fx.Node) and src.target in (aten.max_pool2d_with_indices.default,
                                                       aten.max_pool3d_with_indices.default)


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


def analyze(joint: fx.GraphModule, num_fwd_outputs: int, cost_model: CostModel | None = None, *,
            compress: bool = True, quantize: Quantize | None = None,
            unread_resident_bytes: int = 0) -> JointGraph:
    """The solver's view of ``joint``. ``compress``: offer lossless codecs (packed bits for bool
    tensors, int32 for max-pooling indices); ``quantize``: offer this lossy codec for floating-point
    activations (see `fxopt.compression`). ``unread_resident_bytes``: memory alive through the
    step that no graph input shows (a module's parameters and buffers the step never reads, such
    as Llama's ``original_inv_freq``); the graph gets one more input node of that size, last, so
    that every peak counts it as the measured peak does."""
    cost_model = cost_model or CostModel()
    fx_nodes = [n for n in joint.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(fx_nodes)}
    out_node = next(iter(joint.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    fwd_outs = {o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    bwd_outs = {o for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node)}

    for n in fx_nodes:
        if n.op == "placeholder" and not (n.name.startswith("primals") or n.name.startswith("tangents")):
            raise CaptureError(
                f"unsupported input {n.name!r} of the captured step: fxopt handles parameters, buffers, "
                "tensor inputs and incoming gradients. Pass it as a tensor argument of forward() or "
                "register it on the module (register_buffer)."
            )
        if n.op == "get_attr":
            _check_constant(joint, n)
        val = n.meta.get("val")
        for t in _tensors(val):
            if any(not isinstance(s, int) for s in t.shape):
                raise CaptureError(
                    f"{n.name} has a symbolic shape {tuple(t.shape)}; fxopt plans for static shapes "
                    "(it re-plans when shapes change)"
                )

    # Backward values: those that depend on a tangent, and gradients the forward does not need.
    depends_on_tangent = tangent_dependents(joint.graph)
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
    }

    increases = op_increases(fx_nodes)
    storage_owner: dict[StorageWeakRef, int] = {}
    nodes: list[Node] = []
    codecs: dict[int, Codec] = {}
    for i, n in enumerate(fx_nodes):
        val = n.meta.get("val")
        tensors = _tensors(val)
        storage = None
        own_bytes = 0
        if isinstance(val, torch.Tensor):
            ref = StorageWeakRef(val.untyped_storage())
            if ref in storage_owner:
                storage = storage_owner[ref]
            else:
                storage_owner[ref] = i
                own_bytes = _nbytes(val)
        elif tensors and all(StorageWeakRef(t.untyped_storage()) in storage_owner for t in tensors) and len(
                {storage_owner[StorageWeakRef(t.untyped_storage())] for t in tensors}) == 1:
            # A tuple of views (split, unbind, chunk): while the tuple lives, so does their base.
            storage = storage_owner[StorageWeakRef(tensors[0].untyped_storage())]
        elif tensors:
            # Outputs taken out by getitem are owned by the getitem; the rest die with the tuple.
            taken = {u.args[1] for u in n.users if u.target is operator.getitem}
            items = val if isinstance(val, (list, tuple)) else []
            for k, t in enumerate(items):
                if isinstance(t, torch.Tensor) and k not in taken and StorageWeakRef(t.untyped_storage()) not in storage_owner:
                    own_bytes += _nbytes(t)
        if n.op in ("placeholder", "get_attr"):
            kind = "input"
        elif n in backward:
            kind = "backward"
        else:
            kind = "forward"
        recomputable = n.op == "call_function" and _is_recomputable(n)
        if n.target is operator.getitem and not _is_recomputable(n.args[0]):
            recomputable = False
        flops = _flops(n) if n.op == "call_function" else 0
        moved = own_bytes + sum(
            _nbytes(t) for a in n.all_input_nodes for t in _tensors(a.meta.get("val"))
        ) if n.op == "call_function" and storage is None else 0
        codec = None
        if kind == "forward" and storage is None and (compress or quantize is not None):
            lossy = quantize if quantize is not None and _quantizable(n) else None
            codec = codec_for(val, lossless=compress, quantize=lossy, indices_of_pool=_is_pool_indices(n))
        codec_flops, codec_cost = 0, 0.0
        if codec is not None:
            codecs[i] = codec
            codec_flops = codec.elementwise_flops(val.numel())
            codec_cost = 2 * cost_model.seconds(codec_flops // 2, own_bytes + codec.compressed_bytes, False)
        nodes.append(
            Node(
                name=n.name,
                kind=kind,
                inputs=tuple(index[a] for a in n.all_input_nodes),
                bytes=own_bytes,
                workspace=_scratch(increases.get(n, 0), own_bytes),
                flops=flops,
                cost=0.0 if n.op in ("placeholder", "get_attr") else cost_model.seconds(flops, moved, storage is not None),
                storage=storage,
                recomputable=recomputable,
                output=n in fwd_outs or n in bwd_outs,
                tangent=n.op == "placeholder" and n.name.startswith("tangents"),
                tensor=isinstance(val, torch.Tensor),
                codec=None if codec is None else codec.name,
                compressed_bytes=0 if codec is None else codec.compressed_bytes,
                codec_cost=codec_cost,
                codec_flops=codec_flops,
            )
        )
    if codecs:
        workspace = _codec_workspace({i: (fx_nodes[i], c) for i, c in codecs.items()})
        nodes = [dataclasses.replace(n, codec_workspace=workspace.get(i, 0)) for i, n in enumerate(nodes)]
    names = [n.name for n in fx_nodes]
    module_paths = [_module_path(n) for n in fx_nodes]
    if unread_resident_bytes > 0:
        nodes.append(Node(name=UNREAD_RESIDENT, kind="input", bytes=unread_resident_bytes, recomputable=False))
        names.append(UNREAD_RESIDENT)
        module_paths.append("")
    graph = Graph(tuple(nodes))
    return JointGraph(
        module=joint,
        graph=graph,
        names=tuple(names),
        num_fwd_outputs=num_fwd_outputs,
        module_paths=tuple(module_paths),
        codecs=codecs,
    )
