"""The solvers' view of a training step: a torch-free DAG of values with sizes and costs.

Each node is one value of the joint forward+backward graph. Nothing here knows about torch:
`fxopt.analysis` builds a `Graph` from an aten-level fx graph, and tests build them by hand.

Kinds of node:
  - ``input``: parameters, buffers and user inputs (resident for the whole step) and tangents
    (``tangent=True``: the incoming gradients, alive from the start of the backward until last use).
  - ``forward``: values that do not depend on a tangent. Each may be SAVEd for the backward or
    RECOMPUTEd there (possibly more than once). Forward values that only the backward needs
    ("backward-only", e.g. ``detach(relu)``) are computed in the backward unless saved.
  - ``backward``: values that depend on a tangent. They run once, in graph order.

Storage: a node either owns ``bytes`` of fresh storage (``storage == its own index``) or aliases
the storage of an earlier node (views, ``detach``, ``getitem`` of an aliasing op) and then costs
nothing, but keeps its root's storage alive.

Transfers: a graph may carry the bandwidths between device and host memory (``transfers``, see
`fxopt.solvers.transfers`); only then may a schedule OFFLOAD a value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

from fxopt.solvers.transfers import Transfers

Kind = Literal["input", "forward", "backward"]


# Codecs that lose precision (`fxopt.analysis.codecs`'s quantizing formats); a codec's name starts
# with its format ("int8/g64", ...).
LOSSY_FORMATS = ("int8", "fp8", "int4")


def is_lossy_codec(codec: str | None) -> bool:
    return codec is not None and codec.split("/")[0] in LOSSY_FORMATS


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    kind: Kind
    inputs: tuple[int, ...] = ()
    bytes: int = 0
    workspace: int = 0  # scratch memory the op holds only while it runs (e.g. im2col buffers)
    flops: int = 0
    cost: float = 0.0
    storage: int | None = None  # index of the node owning this value's storage; None: itself
    recomputable: bool = True
    output: bool = False  # a forward output (held by the caller) or a gradient (kept after the step)
    tangent: bool = False
    tensor: bool = True  # False for tuples and other non-tensor values: they can never be SAVEd
    # COMPRESS: a codec that can keep this value, once SAVEd, in ``compressed_bytes`` between its
    # last forward use and its first backward read, for ``codec_cost`` seconds (``codec_flops``)
    # of encoding plus decoding (see `fxopt.analysis.codecs`). None: it is saved as it is.
    codec: str | None = None
    compressed_bytes: int = 0
    codec_cost: float = 0.0
    codec_flops: int = 0
    codec_workspace: int = 0  # scratch bytes while encoding or decoding, beyond input and output
    # Facts the simple policies read (`fxopt.solvers.policies`): the repeated modules (blocks)
    # this value is computed in, by id, outermost first; and its op's class ("matmul",
    # "attention", "convolution"; "pointwise", which the cost model may price as fused,
    # `fxopt.analysis.CostModel.fused_pointwise`; "" for any other op).
    blocks: tuple[int, ...] = ()
    op_class: str = ""
    # The backward formula (one autograd node's, numbered as AOTAutograd numbers them) that eager
    # autograd computes this value in; None for what eager computes in its forward (and for nodes
    # a rewrite added). Eager keeps what a formula reads from outside it until the whole formula
    # has run (`simulate`'s ``eager_frees``); a forward value with one (a formula's value that
    # reads no incoming gradient, such as RMSNorm's ``pow(x, 1)``) is made in eager's backward
    # from what it reads, which eager keeps instead (`save_all_set`). Schedules may still SAVE it.
    backward_formula: int | None = None
    # The formula is the backward of a custom ``autograd.Function`` (Python code, as Bloom's GELU):
    # its temporaries die as Python drops them, not when the formula returns (`_formula_ends`).
    python_formula: bool = False
    # Eager runs this op in place on its first input, a buffer its formula made (functionalization
    # made ``grad.new_zeros(n).slice(...).copy_(g)`` a ``slice_scatter``), or it is a sum eager
    # never makes (an incoming gradient eager does not get, added to one it makes: the logits'
    # of an LM that returns them beside its loss): in the eager step's memory it is a view of
    # its first input that eager makes (`eager_timeline`).
    eager_in_place: bool = False
    # Values eager's autograd node for this backward formula saves that the graph's formula does
    # not read (``gather``'s input, of which the traced formula reads only the sizes: see
    # `fxopt.analysis.eager_saves`), on the formula's first node: in the eager step's memory
    # they live until the formula has run (`eager_timeline`), as if this node read them.
    eager_reads: tuple[int, ...] = ()
    # Bytes of the Python numbers eager wraps into tensors for this op (``x * 0.5`` runs
    # ``mul.Tensor(x, tensor(0.5, dtype=float64))``), which eager autograd may keep for the
    # backward: counted in the eager step's memory, from the op on (`simulate`'s ``eager_frees``).
    eager_number_bytes: int = 0
    # The bytes of this value in eager's own step where they are not ``bytes``: on CPU, eager's
    # dropout keeps a mask of its input's dtype, not a bool one (``at::dropout`` runs the fused
    # ``native_dropout`` only on accelerators). Counted in the eager step's memory (`eager_timeline`).
    eager_bytes: int | None = None
    # Bytes a collective (an all-gather, a reduce-scatter) moves over the process group to make this value; its
    # ``cost`` counts them at the cost model's ``comm_bytes_per_second``. A recomputed all-gather
    # is a re-gather (FSDP's reshard after forward): reported as communication, not FLOPs.
    comm_bytes: int = 0
    # Seconds that collective occupies the process group (``comm_bytes`` at the cost model's rate),
    # and the part of them ``cost`` counts: a re-gather is issued ahead of its wait in the
    # backward (`fxopt.solvers.prefetch`), so only the time the step waits for it is on its path.
    # ``comm_exposed`` is that wait as predicted before any plan exists; the simulator gives each
    # plan's own (`Timeline.exposed_comm_seconds`). Both 0: the whole communication is in ``cost``
    # (a node priced without overlap, as before `fxopt.analysis.CostModel.overlap_regathers`).
    # A collective of the backward waited where issued (a gradient's reduce-scatter or all-reduce)
    # has its whole communication in ``cost`` too, ``comm_exposed`` 0, and ``comm_seconds`` the time
    # it holds the process group, where a re-gather in flight delays it (`prefetch.holds_group`).
    comm_seconds: float = 0.0
    comm_exposed: float = 0.0
    # Bytes a collective leaves allocated after its wait returns, which its process group's worker
    # thread frees when it lets go of the work, at a moment this process does not order: gloo's
    # copy of a reduce-scatter's input (measured: freed as late as the next collective's issue).
    # The simulator, and the profiles the ILP and the bounds count with, hold them until the wait of
    # the next collective that lingers has run (`fxopt.solvers.liveness.Lingering`; or the
    # backward ends): an upper bound where the rewritten step frees them itself (on gloo,
    # `fxopt.ops.collectives.reduce_scatter` frees the copy before it returns). Where the step
    # waits for it later than it issues it (`fxopt.solvers.prefetch.prefetched`), the simulator
    # holds the copy from the issue to that wait, exactly (`Lingering.exact`).
    lingers: int = 0

    def replaced(self, **changes) -> Node:
        """``dataclasses.replace(self, **changes)`` without its per-field work (a node has no
        ``__post_init__`` and no field outside ``__init__``): the same node, 6 times sooner. A
        symbolic step's graph is made anew at every batch `fxopt.max_batch` tries (7,858 nodes
        on Llama-3-8B's shape, 33 graphs in one `fxopt.fit`: 2.6 s of ``dataclasses.replace``)."""
        if not changes.keys() <= _NODE_FIELD_SET:
            raise TypeError(f"Node has no field {sorted(changes.keys() - _NODE_FIELD_SET)[0]!r}")
        node = object.__new__(Node)
        node.__dict__.update(self.__dict__)
        node.__dict__.update(changes)
        return node


# A node's fields, as `Graph.to_dict` reads them (as they are: numbers, strings and tuples of
# numbers; `dataclasses.asdict`'s deep copy took 0.56 s of a 7,600-node step's plan).
_NODE_FIELDS = tuple(f.name for f in dataclasses.fields(Node))
_NODE_FIELD_SET = frozenset(_NODE_FIELDS)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A topologically ordered list of nodes (inputs of a node precede it), and the bandwidths of
    the copies to and from host memory (None: OFFLOAD is not offered)."""

    nodes: tuple[Node, ...]
    transfers: Transfers | None = None

    def __post_init__(self) -> None:
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                if not 0 <= j < i:
                    raise ValueError(f"node {i} ({node.name}) has input {j} that does not precede it")
            if node.storage is not None and not 0 <= node.storage <= i:
                raise ValueError(f"node {i} ({node.name}) aliases storage {node.storage} that does not precede it")
            if node.tangent and node.kind != "input":
                raise ValueError(f"node {i} ({node.name}) is a tangent but not an input")

    def __len__(self) -> int:
        return len(self.nodes)

    def root(self, i: int) -> int:
        """The node whose storage `i` lives in."""
        s = self.nodes[i].storage
        return i if s is None or s == i else self.root(s)

    @functools.cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in dict.fromkeys(node.inputs):
                users[j].append(i)
        return tuple(tuple(u) for u in users)

    @functools.cached_property
    def roots(self) -> tuple[int, ...]:
        return tuple(self.root(i) for i in range(len(self.nodes)))

    @functools.cached_property
    def free(self) -> frozenset[int]:
        """Forward values that cost nothing to keep: aliases of resident values or forward outputs."""
        keep = self.resident | self.forward_outputs
        return frozenset(
            i for i, n in enumerate(self.nodes)
            if n.kind == "forward" and self.roots[i] in keep and self.roots[i] != i
        ) | self.resident

    @functools.cached_property
    def tuple_items(self) -> frozenset[int]:
        """Values taken out of a multi-output op's tuple (getitem) into storage of their own. The
        op allocates them all; the tuple keeps each alive for as long as the tuple itself lives."""
        return frozenset(
            i for i, n in enumerate(self.nodes)
            if len(n.inputs) == 1 and not self.nodes[n.inputs[0]].tensor and self.nodes[n.inputs[0]].kind != "input"
            and self.roots[i] == i and n.tensor
        )

    @functools.cached_property
    def aliases(self) -> frozenset[int]:
        """Forward values that are views of other forward values (not free). Schedules never
        SAVE them: they make a fresh one from the base just before each use, which costs nothing
        and never keeps an old copy of the base alive."""
        return frozenset(
            i for i, n in enumerate(self.nodes)
            if n.kind == "forward" and self.roots[i] != i and i not in self.free and n.recomputable
        )

    def through_aliases(self, ids) -> frozenset[int]:
        """`ids` with every alias replaced by what it is made from, recursively."""
        out: set[int] = set()
        stack = list(ids)
        while stack:
            i = stack.pop()
            if i in self.aliases:
                stack.extend(self.nodes[i].inputs)
            else:
                out.add(i)
        return frozenset(out)

    @functools.cached_property
    def resident(self) -> frozenset[int]:
        """Values alive for the whole step at no cost: non-tangent inputs and their aliases."""
        out: set[int] = set()
        for i, node in enumerate(self.nodes):
            if node.kind == "input" and not node.tangent:
                out.add(i)
            elif node.kind == "forward" and self.roots[i] in out and all(j in out for j in node.inputs):
                out.add(i)
        return frozenset(out)

    @functools.cached_property
    def forward_outputs(self) -> frozenset[int]:
        return frozenset(i for i, n in enumerate(self.nodes) if n.kind == "forward" and n.output)

    @functools.cached_property
    def backward_nodes(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) if n.kind == "backward")

    @functools.cached_property
    def forward_required(self) -> frozenset[int]:
        """Forward values the forward pass computes whatever the plan: ancestors of its outputs."""
        return self.ancestors(self.forward_outputs, kinds=("forward",))

    @functools.cached_property
    def backward_needs(self) -> frozenset[int]:
        """Forward values read directly by backward nodes."""
        return frozenset(
            j for b in self.backward_nodes for j in self.nodes[b].inputs if self.nodes[j].kind == "forward"
        )

    @functools.cached_property
    def needed_by_backward(self) -> frozenset[int]:
        """Forward values the backward needs, directly or through recomputation (which stops at
        values that cannot be recomputed: those must be saved)."""
        seen: set[int] = set()
        stack = list(self.backward_needs)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if self.nodes[i].recomputable:
                stack.extend(j for j in self.nodes[i].inputs if self.nodes[j].kind == "forward")
        return frozenset(seen)

    @functools.cached_property
    def backward_only(self) -> frozenset[int]:
        """Forward values that only the backward needs: computed there unless saved."""
        return self.needed_by_backward - self.forward_required

    @functools.cached_property
    def saveable(self) -> frozenset[int]:
        """Forward values that can be SAVEd: computed in the forward anyway, or backward-only values
        whose inputs are all available in the forward. Not `aliases`: a schedule makes a view fresh
        from its base before each use (so every schedule pays for the views the backward reads, a
        cost the lower bounds count)."""
        avail = self.forward_required | self.resident
        out = {i for i in self.forward_required - self.resident - self.aliases if self.nodes[i].tensor}
        for i in sorted(self.backward_only - self.resident - self.aliases):
            if self.nodes[i].tensor and all(j in avail for j in self.nodes[i].inputs):
                out.add(i)
        return frozenset(out)

    @functools.cached_property
    def movable(self) -> frozenset[int]:
        """SAVEable values that own their storage, which neither they nor a view of them outlives
        the step (a forward output) or is saved in their place: what COMPRESS and OFFLOAD may
        store elsewhere than the value itself."""
        held = {self.roots[i] for i in self.forward_outputs | self.resident}
        return frozenset(i for i in self.saveable if self.roots[i] == i and i not in held)

    @functools.cached_property
    def compressible(self) -> frozenset[int]:
        """`movable` values that may be COMPRESSed: they have a codec that makes them smaller."""
        return frozenset(i for i in self.movable
                         if self.nodes[i].codec is not None and self.nodes[i].compressed_bytes < self.nodes[i].bytes)

    @functools.cached_property
    def offloadable(self) -> frozenset[int]:
        """`movable` values that may be OFFLOADed (kept in host memory between forward and
        backward): none without ``transfers``; else those of some bytes."""
        if self.transfers is None:
            return frozenset()
        return frozenset(i for i in self.movable if self.nodes[i].bytes > 0)

    def with_transfers(self, transfers: Transfers | None) -> Graph:
        """The same values with these bandwidths (None: without OFFLOAD)."""
        return Graph(self.nodes, transfers)

    def ancestors(self, seeds, kinds: Sequence[Kind] = ("forward",)) -> frozenset[int]:
        """`seeds` and everything they depend on, restricted to nodes of the given kinds."""
        seen: set[int] = set()
        stack = [s for s in seeds if self.nodes[s].kind in kinds]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            stack.extend(j for j in self.nodes[i].inputs if self.nodes[j].kind in kinds and j not in seen)
        return frozenset(seen)

    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def to_dict(self) -> dict:
        # (No "transfers" key without them: a graph's dict, and the plan cache's key made from it,
        # stay what they were before OFFLOAD.)
        # (Nor these keys on a node that moves nothing over the process group.)
        quiet = ("comm_bytes", "lingers", "comm_seconds", "comm_exposed")
        d: dict = {"nodes": [{k: v for k in _NODE_FIELDS if (v := getattr(n, k)) or k not in quiet}
                             for n in self.nodes]}
        if self.transfers is not None:
            d["transfers"] = self.transfers.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Graph:
        transfers = d.get("transfers")
        return cls(tuple(Node(**{**n, **{k: tuple(n.get(k, ())) for k in ("inputs", "blocks", "eager_reads")}})
                         for n in d["nodes"]),
                   None if transfers is None else Transfers.from_dict(transfers))
