"""Split a joint graph into forward and backward modules following a schedule (SAVE / RECOMPUTE).

The forward computes what it must, in graph order (its all-gathers issued ahead of their first use,
as the simulator issues them: `fxopt.passes.waits.issue_gathers_ahead`), and returns its outputs
plus the SAVEd values.
The backward runs the schedule's events in order: each backward node once, and a copy of a
forward node wherever the schedule recomputes it, reading the most recent copy of each value.

    joint:    a = relu(x); b = mm(a, w); ...; gb = grad(b); ga = threshold_backward(gb, a)
    schedule: saved = {}, backward = [gb, a, ga]     (a is recomputed just before its use)
    forward:  a = relu(x); b = mm(a, w); return (b,)
    backward: gb = grad(b); a_1 = relu(x); ga = threshold_backward(gb, a_1)

A COMPRESSed value (``schedule.compressed``) is encoded in the forward right after its last use
there (and its views'), and the forward saves the encoding; the backward decodes it right before
its first read (see `fxopt.analysis.codecs`). An OFFLOADed value (``schedule.offloaded``; its
encoding, if also COMPRESSed) is copied to host memory after its last forward use, the forward
saves the host copy, and the backward copies it back at the plan's reload point (see
`fxopt.passes.offload`).

Because every value dies after its last use, where a recomputation sits decides how long it lives,
and recomputing a value twice (two copies) can be cheaper in memory than keeping one.

The modules follow AOTAutograd's calling convention: the forward returns (outputs..., saved...),
the backward takes (saved..., tangents...) and returns the gradients of the primals.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._functorch import partitioners as _p
from torch.fx.experimental.symbolic_shapes import find_symbol_binding_fx_nodes, free_symbols

from fxopt.analysis import JointGraph
from fxopt.errors import CaptureError
from fxopt.fxgraph import NodeBuilder
from fxopt.passes.offload import Reloads, offload_saved, reload_positions
from fxopt.passes.waits import issue_gathers_ahead, sink_all_reduce_waits, wait_for_release
from fxopt.solvers.prefetch import is_regather
from fxopt.solvers.schedule import (Schedule, forward_order, kept_steps, prune, read_before_recompute, simulate,
                                    with_prefetch)


# For each COMPRESSed value of symbolic shape: its sizes as the forward saves them, by their
# expression (``SymInt.node.expr``).
SavedDims = dict[str, dict[object, fx.Node]]


def split_with_recompute(joint: JointGraph, schedule: Schedule) -> tuple[fx.GraphModule, fx.GraphModule]:
    # Recomputations nothing reads are dropped here, as the simulator drops them, before choosing
    # what to save: a value saved only for one of them would be a backward input nothing reads,
    # and FX code never frees such an input (the simulator frees it as the backward starts).
    # Re-gathers are issued ahead of their waits, as the simulator places them (`fxopt.solvers.prefetch`).
    planned, schedule = schedule, with_prefetch(joint.graph, prune(joint.graph, schedule))
    module = joint.module
    by_name = {n.name: n for n in module.graph.nodes}
    nodes = joint.graph.nodes
    placeholders = list(module.graph.find_nodes(op="placeholder"))
    primals = [n for n in placeholders if _p._is_primal(n)]
    tangents = [n for n in placeholders if _p._is_tangent(n)]
    if len(primals) + len(tangents) != len(placeholders):
        other = [n.name for n in placeholders if n not in primals and n not in tangents]
        raise CaptureError(f"unsupported inputs of the captured step: {other}")

    # What the backward reads from the forward: SAVEd values, and the inputs (parameters, user
    # inputs) and forward outputs it or its recomputations use; those cost nothing, they are
    # alive anyway (the caller holds the outputs, as the simulator counts them: a model that
    # returns normalised embeddings, CLIP's, has its backward read them).
    # A SAVEd value counts only if the backward reads it before recomputing it: a saved tensor
    # nothing reads would stay alive for nothing.
    read = read_before_recompute(joint.graph, schedule.backward)
    wanted = (set(schedule.saved) & read) | (read & joint.graph.forward_outputs) | {
        j for j in read if nodes[j].kind == "input" and not nodes[j].tangent
    }
    # Tensor constants (``get_attr``) are read from the module by each graph that needs them.
    constants = [by_name[joint.names[i]] for i in sorted(wanted) if by_name[joint.names[i]].op == "get_attr"]
    saved = [by_name[joint.names[i]] for i in sorted(wanted)
             if nodes[i].tensor and by_name[joint.names[i]].op != "get_attr"]
    # Sizes (SymInts, with dynamic shapes) the backward reads, and the symbols of what it takes.
    sizes = [by_name[joint.names[i]] for i in sorted(wanted) if nodes[i].kind == "input" and not nodes[i].tensor]

    fwd_outputs, bwd_outputs, fwd_descs, bwd_descs = _p._extract_fwd_bwd_outputs(
        module, num_fwd_outputs=joint.num_fwd_outputs
    )
    sizes = _with_bindings(module.graph, sizes, saved + tangents)
    fw_graph = _p._extract_graph_with_inputs_outputs(
        module.graph,
        primals,
        fwd_outputs + saved + sizes,
        fwd_descs + [_p.SavedForBackwardsAOTOutput(k) for k in range(len(saved) + len(sizes))],
        "forward",
    )
    _issue_ahead(fw_graph, joint, planned)
    index = {name: i for i, name in enumerate(joint.names)}
    compressed = {joint.names[i] for i in schedule.compressed if i in wanted}
    offloaded = {joint.names[i] for i in schedule.offloaded if i in wanted}
    last = _last_readers(fw_graph, joint, compressed | offloaded, index)
    encoded = _encode(fw_graph, joint, compressed, last) if compressed else {}
    dims = _saved_dims(fw_graph, joint, encoded, len(fwd_outputs) + len(saved)) if compressed else {}
    reloads = None
    if offloaded:
        # A plan pins its reload points (`Plan.build`); a bare schedule reloads where the simulator
        # would by default.
        reload_at = planned.reload_at or simulate(joint.graph, planned).reload_at
        at = reload_positions(len(planned.backward), kept_steps(joint.graph, planned), reload_at, joint.names)
        reloads = _offload(fw_graph, saved, encoded, offloaded, last, at)

    graph = _backward_graph(joint, schedule, sizes + saved + tangents, constants, encoded, reloads, bwd_outputs, dims)
    sink_all_reduce_waits(graph)
    wait_for_release(fw_graph)
    wait_for_release(graph)
    next(iter(graph.find_nodes(op="output"))).meta["desc"] = bwd_descs  # AOTAutograd's descriptors
    graph.eliminate_dead_code()
    fw = fx._lazy_graph_module._make_graph_module(module, fw_graph)
    bw = fx._lazy_graph_module._make_graph_module(module, graph)
    if reloads is not None:  # both modules keep the copies' state (the ops find it by key)
        fw._fxopt_host_copies = bw._fxopt_host_copies = reloads.copies
    bw.graph.lint()
    return fw, bw


def _issue_ahead(fw_graph: fx.Graph, joint: JointGraph, schedule: Schedule) -> None:
    """The forward's all-gathers issued ahead of their first use where the simulator issues them
    (`fxopt.solvers.schedule.forward_order`)."""
    order = forward_order(joint.graph, schedule)
    if order == sorted(order):
        return
    names = [joint.names[i] for i in order]
    issue_gathers_ahead(fw_graph, names, {joint.names[i] for i in order if is_regather(joint.graph, i)})


def _offload(fw_graph: fx.Graph, saved: list[fx.Node], encoded: dict[str, fx.Node], names: set[str],
             last: dict[str, fx.Node], at: dict[int, list[str]]) -> Reloads:
    """Offload ``names`` in the forward: each right after its last use, or, if COMPRESSed, its
    encoding right after it is made (the encoding travels)."""
    by_name = {n.name: n for n in fw_graph.nodes}
    order = [n.name for n in saved if n.name in names]
    travels = {name: encoded.get(name, by_name[name]) for name in order}
    after = {name: encoded[name] if name in encoded else last[name] for name in order}
    return offload_saved(fw_graph, travels, after, at)


def _backward_graph(joint: JointGraph, schedule: Schedule, inputs: list[fx.Node], constants: list[fx.Node],
                    encoded: dict[str, fx.Node], reloads: Reloads | None, bwd_outputs,
                    dims: SavedDims) -> fx.Graph:
    """The backward: the schedule's steps in order, each reading the most recent copy of each
    value; a COMPRESSed value decoded and an OFFLOADed one waited for before its first reader
    (its reload issued where ``reloads`` says; its symbolic sizes read from ``dims``)."""
    module = joint.module
    by_name = {n.name: n for n in module.graph.nodes}
    index = {name: i for i, name in enumerate(joint.names)}
    graph = fx.Graph()
    if reloads is not None:
        reloads.begin(graph)
    current: dict[str, fx.Node] = {}
    packed: dict[str, fx.Node] = {}  # compressed value -> its encoding, until decoded
    dim_inputs = {}  # (compressed value, size expression) -> the size; first, as the forward returns them
    for name, by_expr in dims.items():
        for expr, fw_node in by_expr.items():
            dim_inputs[name, expr] = new = graph.placeholder(fw_node.name)
            new.meta = dict(fw_node.meta)
    for n in inputs:
        travels = encoded.get(n.name, n)
        new = graph.placeholder(travels.name)
        new.meta = dict(travels.meta)
        if reloads is not None and n.name in reloads.slot:
            reloads.add_host_copy(n.name, new)
        elif n.name in encoded:
            packed[n.name] = new
        else:
            current[n.name] = new
    for n in constants:
        current[n.name] = graph.node_copy(n)
    for position, i in enumerate(schedule.backward):
        if reloads is not None:
            reloads.issue(position)
        original = by_name[joint.names[i]]
        for a in original.all_input_nodes:
            if reloads is not None and a.name in reloads:
                (packed if a.name in encoded else current)[a.name] = reloads.arrive(a.name)
            if a.name in packed:
                codec = joint.codecs[index[a.name]]
                args = fx.node.map_aggregate(codec.decompress_args, lambda x: dim_inputs[a.name, x.node.expr]
                                             if isinstance(x, torch.SymInt) else x)
                new = graph.call_function(codec.decompress_op, (packed.pop(a.name), *args))
                new.meta = {"val": a.meta["val"], "autograd_backward": True}
                current[a.name] = new
        missing = [a.name for a in original.all_input_nodes if a.name not in current]
        if missing:
            raise AssertionError(f"schedule computes {original.name} before {missing} is available")
        new = graph.node_copy(original, lambda a: current[a.name])
        new.meta["autograd_backward"] = True
        current[original.name] = new
    graph.output(tuple(fx.node.map_arg(o, lambda a: current[a.name]) if o is not None else None
                       for o in bwd_outputs))
    return graph


def _with_bindings(graph: fx.Graph, sizes: list[fx.Node], taken: list[fx.Node]) -> list[fx.Node]:
    """``sizes`` the backward reads, after the nodes binding every symbol in them and in the
    values it ``taken`` (AOTAutograd's convention: a graph receives each symbol it uses)."""
    bindings = find_symbol_binding_fx_nodes(graph)
    bound = {b for s, b in bindings.items()}
    out = [n for n in sizes if n in bound]
    symbols = {s for s, b in bindings.items() if b in out}
    for n in [*sizes, *taken]:
        for s in sorted(free_symbols(n.meta.get("val")) - symbols, key=lambda s: s.name):
            if s in bindings:
                out.append(bindings[s])
                symbols.add(s)
    return list(dict.fromkeys(out + [n for n in sizes if n not in bound]))


def _saved_dims(fw_graph: fx.Graph, joint: JointGraph, encoded: dict[str, fx.Node],
                first_sym_output: int) -> SavedDims:
    """A decoder needs the shape of what it decodes: for each COMPRESSed value of symbolic
    shape, its sizes (``sym_size``) taken in the forward right after it is encoded and returned
    among the saved sizes (after the saved tensors), by expression."""
    by_name = {n.name: n for n in fw_graph.nodes}
    out_node = next(iter(fw_graph.find_nodes(op="output")))
    dims: SavedDims = {}
    for name, enc in encoded.items():
        value = by_name[name]
        for d, size in enumerate(value.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr not in dims.get(name, {}):
                with fw_graph.inserting_after(enc):
                    node = fw_graph.call_function(torch.ops.aten.sym_size.int, (value, d))
                node.meta["val"] = size
                dims.setdefault(name, {})[size.node.expr] = node
    if dims:
        outs = list(out_node.args[0])
        new = [n for by_expr in dims.values() for n in by_expr.values()]
        out_node.args = (tuple(outs[:first_sym_output] + new + outs[first_sym_output:]),)
        descs = out_node.meta.get("desc")
        if descs is not None:
            out_node.meta["desc"] = list(descs) + [_p.SavedForBackwardsAOTOutput(len(descs) + k) for k in range(len(new))]
    return dims


def _last_readers(fw_graph: fx.Graph, joint: JointGraph, names: set[str], index: dict[str, int]) -> dict[str, fx.Node]:
    """For each of ``names``, the last node of the forward that reads the value or a view of it
    (the value itself if nothing does)."""
    roots = joint.graph.roots
    by_name = {n.name: n for n in fw_graph.nodes}
    last_reader: dict[str, fx.Node] = {name: by_name[name] for name in names}
    for n in fw_graph.nodes:
        if n.op == "output":
            continue
        for a in n.all_input_nodes:
            if a.name in index:
                root = joint.names[roots[index[a.name]]]
                if root in names:
                    last_reader[root] = n
    return last_reader


def _encode(fw_graph: fx.Graph, joint: JointGraph, names: set[str], last_reader: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Insert each compressed value's encoding into the forward, right after the last node that
    reads the value or a view of it, and return it in place of the value."""
    index = {name: i for i, name in enumerate(joint.names)}
    by_name = {n.name: n for n in fw_graph.nodes}
    out_node = next(iter(fw_graph.find_nodes(op="output")))
    encoded = {}
    for name in names:
        value = by_name[name]
        codec = joint.codecs[index[name]]
        node = NodeBuilder(fw_graph, last_reader[name], value)(codec.compress_op, value, *codec.compress_args)
        encoded[name] = node
    outs = list(out_node.args[0])
    out_node.args = (tuple(encoded.get(o.name, o) if isinstance(o, fx.Node) else o for o in outs),)
    return encoded
