"""The simple policies a user already has, as schedules the simulator scores like any other, so
that "auto" never answers with a plan costlier than the best of them that fits.

- ``blocks-<k>``: `torch.utils.checkpoint` around each repeated block (`repeated_blocks`: an HF
  decoder layer, a diffusers ResNet or transformer block, a timm stage's block), taking the
  blocks ``k`` levels down where blocks nest (a value inside fewer takes its innermost). SAVE
  what the backward reads outside the blocks, what enters each block from outside it, and what
  leaves a block for the backward of an op outside it; RECOMPUTE the rest, in the backward, from
  those. (`on_demand` recomputes what each backward node needs just before it rather than the
  whole block at its first unpack: the same values, each at most once, and never more memory.)
- ``selective``: torch's selective-checkpoint default (torchtitan's ``SelectiveAC`` op list):
  SAVE the outputs of matrix products and attention, RECOMPUTE the rest from them.
  ``selective-1`` applies it inside each block of ``blocks-1``, as torchtitan does per layer.
  The ``+conv`` variants also save convolutions (the partitioner's compute-intensive ops), on
  graphs that have them.
- ``save_all``: recompute nothing.

For example, with two blocks [a b] and [c d] (d reads b and c) after x::

    x → a → b → c → d → loss          blocks-1 SAVEs x (block 1's input), b (block 2's input)
        [blocks 1] [ block 2 ]        and what loss's backward reads; a, c and d are recomputed.

The policies read two plain facts per node that the analysis records from the model
(`fxopt.analysis.joint`): ``Node.blocks`` and ``Node.op_class``. A graph without them (built by
hand, or a model of one module) gets ``selective`` and ``save_all`` only where it has the ops.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxopt.solvers.graph import Graph
from fxopt.solvers.schedule import InvalidScheduleError, Schedule, Timeline, on_demand, save_all_set, simulate

Candidate = tuple[Schedule, Timeline]

# What torch's selective checkpointing saves: torchtitan's ``_op_sac_save_list`` (matrix products
# and the scaled-dot-product attention kernels); with convolutions, functorch's compute-intensive ops.
SELECTIVE_OPS = frozenset({"matmul", "attention"})
COMPUTE_INTENSIVE_OPS = SELECTIVE_OPS | {"convolution"}


def repeated_blocks(stacks: Sequence[Sequence[tuple[str, str]]]) -> list[tuple[int, ...]]:
    """Per node, the ids of the repeated blocks it is computed in, outermost first (its
    ``Node.blocks``). ``stacks[i]``: the modules node ``i`` runs inside, as (path, class name),
    outermost first (fx's ``nn_module_stack``). A repeated block is a module whose class another
    module at the same depth also has, and inside which another module runs (a leaf, one Linear
    or one norm, is an op, not a block). Ids count the blocks in order of first appearance."""
    paths_of: dict[tuple[int, str], set[str]] = {}
    parents: set[str] = set()
    for stack in stacks:
        for depth, (path, cls) in enumerate(stack):
            paths_of.setdefault((depth, cls), set()).add(path)
            if depth + 1 < len(stack):
                parents.add(path)
    repeated = {p for paths in paths_of.values() if len(paths) > 1 for p in paths} & parents
    ids: dict[str, int] = {}
    return [tuple(ids.setdefault(path, len(ids)) for path, _ in stack if path in repeated) for stack in stacks]


def block_of(graph: Graph, level: int) -> list[int | None]:
    """The block each forward value is in at nesting ``level`` (1: the outermost; a value inside
    fewer blocks takes its innermost), None outside every block. A value the backward derives
    from forward values (backward-only: AOTAutograd made it, no module did) is in the block of
    what it reads, where that is one block."""
    block = [n.blocks[min(level, len(n.blocks)) - 1] if n.blocks and n.kind == "forward" else None
             for n in graph.nodes]
    for i in sorted(graph.backward_only):
        if not graph.nodes[i].blocks:
            read = {block[j] for j in graph.nodes[i].inputs if graph.nodes[j].kind == "forward"}
            if len(read) == 1:
                block[i] = read.pop()
    return block


def checkpointed(graph: Graph, block: Sequence[int | None]) -> frozenset[int]:
    """The SAVE set of `torch.utils.checkpoint` around each block: what the backward reads
    outside the blocks (as eager keeps it), the values each block reads from outside it (the
    checkpoint's inputs), and a block's outputs that an op outside it reads and the backward
    needs (that op keeps them)."""
    nodes = graph.nodes
    eager = save_all_set(graph)
    keep = {i for i in eager if block[i] is None}
    for i, node in enumerate(nodes):
        if node.kind != "forward":
            continue
        for j in node.inputs:
            if nodes[j].kind != "forward" or block[j] == block[i]:
                continue
            if block[i] is not None or graph.through_aliases([j]) & eager:
                keep.add(j)
    return _saveable(graph, keep)


def selective(graph: Graph, ops: frozenset[str], block: Sequence[int | None] | None = None) -> frozenset[int]:
    """The SAVE set of selective checkpointing: the outputs of ``ops`` the backward needs,
    everything else recomputed from them; with ``block``, inside each block only (the rest as
    `checkpointed`)."""
    chosen = {i for i in graph.needed_by_backward if graph.nodes[i].op_class in ops
              and (block is None or block[i] is not None)}
    return _saveable(graph, chosen) | (checkpointed(graph, block) if block is not None else frozenset())


def _saveable(graph: Graph, values) -> frozenset[int]:
    """``values`` as a schedule may SAVE them: a view by its base, nothing the forward does not make."""
    return graph.through_aliases(values) & (graph.saveable | graph.free)


def policies(graph: Graph) -> dict[str, frozenset[int]]:
    """Each simple policy's SAVE set, by name (see the module docstring); policies that come to
    the same set are named once."""
    op_classes = {n.op_class for n in graph.nodes if n.kind == "forward"}
    variants = [("", SELECTIVE_OPS)] + ([("+conv", COMPUTE_INTENSIVE_OPS)] if "convolution" in op_classes else [])
    out: dict[str, frozenset[int]] = {"save_all": save_all_set(graph)}
    for suffix, ops in variants:
        if ops & op_classes:
            out["selective" + suffix] = selective(graph, ops)
    levels = max((len(n.blocks) for n in graph.nodes if n.kind == "forward"), default=0)
    assignments: set[tuple] = set()
    for level in range(1, levels + 1):
        block = block_of(graph, level)
        if tuple(block) in assignments:
            continue
        assignments.add(tuple(block))
        out[f"blocks-{level}"] = checkpointed(graph, block)
        # (Selective checkpointing per block at the outermost level only, as torchtitan applies
        # it per layer: each policy costs a simulation, and the solvers after them interpolate.)
        for suffix, ops in variants if level == 1 else ():
            if ops & op_classes:
                out[f"selective-{level}{suffix}"] = selective(graph, ops, block)
    distinct: dict[frozenset[int], str] = {}
    for name, saved in out.items():
        distinct.setdefault(saved, name)
    return {name: saved for saved, name in distinct.items()}


def policy_candidates(graph: Graph, budget: int, memo=None) -> list[Candidate]:
    """Every simple policy's schedule (`on_demand` of its SAVE set) and its simulated timeline,
    over the budget or within it (like the heuristics, whatever the budget: compression may
    make one fit); not ``save_all``, which is a heuristic of its own. ``memo``: the planner's
    (`fxopt.solvers.minimum.Memo`), where they are kept per graph (None: made afresh)."""
    # (save_all not simulated at all: a whole-step simulation on a 32-layer step, for nothing)
    named = (named_policy_candidates(graph, without=("save_all",)) if memo is None
             else memo.policies(graph, lambda: named_policy_candidates(graph, without=("save_all",))))
    return [candidate for _, candidate in named]


def named_policy_candidates(graph: Graph, without: tuple[str, ...] = ()) -> list[tuple[str, Candidate]]:
    """`policy_candidates` with each policy's name, save_all's included unless ``without``
    names it (the policies ``without`` names are left out)."""
    out = []
    for name, saved in policies(graph).items():
        if name in without:
            continue
        try:
            schedule = on_demand(graph, saved)
            out.append((name, (schedule, simulate(graph, schedule))))
        except InvalidScheduleError:
            continue  # (as for the ILP's roundings: a policy that cannot run here is no candidate)
    return out
