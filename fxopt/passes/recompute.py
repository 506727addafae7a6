"""Split a joint graph into forward and backward modules following a schedule (SAVE / RECOMPUTE).

The forward computes what it must, in graph order, and returns its outputs plus the SAVEd values.
The backward runs the schedule's events in order: each backward node once, and a copy of a
forward node wherever the schedule recomputes it, reading the most recent copy of each value.

    joint:    a = relu(x); b = mm(a, w); ...; gb = grad(b); ga = threshold_backward(gb, a)
    schedule: saved = {}, backward = [gb, a, ga]     (a is recomputed just before its use)
    forward:  a = relu(x); b = mm(a, w); return (b,)
    backward: gb = grad(b); a_1 = relu(x); ga = threshold_backward(gb, a_1)

A COMPRESSed value (``schedule.compressed``) is encoded in the forward right after its last use
there (and its views'), and the forward saves the encoding; the backward decodes it right before
its first read (see `fxopt.analysis.codecs`).

Because every value dies after its last use, where a recomputation sits decides how long it lives,
and recomputing a value twice (two copies) can be cheaper in memory than keeping one.

The modules follow AOTAutograd's calling convention: the forward returns (outputs..., saved...),
the backward takes (saved..., tangents...) and returns the gradients of the primals.
"""

from __future__ import annotations

import torch.fx as fx
from torch._functorch import partitioners as _p

from fxopt.analysis import JointGraph
from fxopt.errors import CaptureError
from fxopt.fxgraph import NodeBuilder
from fxopt.solvers.schedule import Schedule, prune, read_before_recompute


def split_with_recompute(joint: JointGraph, schedule: Schedule) -> tuple[fx.GraphModule, fx.GraphModule]:
    # Recomputations nothing reads are dropped here, as the simulator drops them, before choosing
    # what to save: a value saved only for one of them would be a backward input nothing reads,
    # and FX code never frees such an input (the simulator frees it as the backward starts).
    schedule = prune(joint.graph, schedule)
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
    # inputs) it or its recomputations use; inputs cost nothing, they are alive anyway.
    # A SAVEd value counts only if the backward reads it before recomputing it: a saved tensor
    # nothing reads would stay alive for nothing.
    read = read_before_recompute(joint.graph, schedule.backward)
    wanted = (set(schedule.saved) & read) | {
        j for j in read if nodes[j].kind == "input" and not nodes[j].tangent
    }
    # Tensor constants (``get_attr``) are read from the module by each graph that needs them.
    constants = [by_name[joint.names[i]] for i in sorted(wanted) if by_name[joint.names[i]].op == "get_attr"]
    saved = [by_name[joint.names[i]] for i in sorted(wanted)
             if nodes[i].tensor and by_name[joint.names[i]].op != "get_attr"]

    fwd_outputs, bwd_outputs, fwd_descs, bwd_descs = _p._extract_fwd_bwd_outputs(
        module, num_fwd_outputs=joint.num_fwd_outputs
    )
    fw_graph = _p._extract_graph_with_inputs_outputs(
        module.graph,
        primals,
        fwd_outputs + saved,
        fwd_descs + [_p.SavedForBackwardsAOTOutput(k) for k in range(len(saved))],
        "forward",
    )
    index = {name: i for i, name in enumerate(joint.names)}
    compressed = {joint.names[i] for i in schedule.compressed if i in wanted}
    encoded = _encode(fw_graph, joint, compressed, index) if compressed else {}

    graph = fx.Graph()
    current: dict[str, fx.Node] = {}
    packed: dict[str, fx.Node] = {}  # compressed value -> its encoding, until decoded
    for n in saved + tangents:
        if n.name in encoded:
            new = graph.placeholder(encoded[n.name].name)
            new.meta = dict(encoded[n.name].meta)
            packed[n.name] = new
            continue
        new = graph.placeholder(n.name)
        new.meta = dict(n.meta)
        current[n.name] = new
    for n in constants:
        current[n.name] = graph.node_copy(n)
    for i in schedule.backward:
        original = by_name[joint.names[i]]
        for a in original.all_input_nodes:
            if a.name in packed:
                codec = joint.codecs[index[a.name]]
                new = graph.call_function(codec.decompress_op, (packed.pop(a.name), *codec.decompress_args))
                new.meta = {"val": a.meta["val"], "autograd_backward": True}
                current[a.name] = new
        missing = [a.name for a in original.all_input_nodes if a.name not in current]
        if missing:
            raise AssertionError(f"schedule computes {original.name} before {missing} is available")
        new = graph.node_copy(original, lambda a: current[a.name])
        new.meta["autograd_backward"] = True
        current[original.name] = new
    out = graph.output(tuple(fx.node.map_arg(o, lambda a: current[a.name]) if o is not None else None for o in bwd_outputs))
    out.meta["desc"] = bwd_descs
    graph.eliminate_dead_code()
    fw = fx._lazy_graph_module._make_graph_module(module, fw_graph)
    bw = fx._lazy_graph_module._make_graph_module(module, graph)
    bw.graph.lint()
    return fw, bw


def _encode(fw_graph: fx.Graph, joint: JointGraph, names: set[str], index: dict[str, int]) -> dict[str, fx.Node]:
    """Insert each compressed value's encoding into the forward, right after the last node that
    reads the value or a view of it, and return it in place of the value."""
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
