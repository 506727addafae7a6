"""The memory model: which storage is alive at each step, and how many bytes that is.

Every memory figure in the solvers comes from the same two pieces:

  - `LiveBytes`: reference counts on storage. A value holds a reference to the storage it lives
    in (its own, or its root's for a view) from the step that makes it until the step that last
    reads it; a storage counts its bytes while anything refers to it.
  - `last_uses`: for a run of steps, the step that last reads each value.

`simulate` (`fxopt.solvers.schedule`) replays a schedule with them, one storage per computed copy
of a value. `profile` walks an order in which every node runs once, one storage per root:

    forward_profile     the forward with nothing SAVEd          ILP and instant program: forward rows
    backward_profile    the backward nodes, forward values      ILP: the fixed part of each stage
                        aside
    fixed_backward_bytes  the same, a lower bound                 instant program and `peak_lower_bound`
                                                                and the chain solver's fixed part

All three count what the simulator counts (outputs are never freed: the caller holds the forward's,
the gradients are kept; tangents are held by the autograd engine for the whole backward; the
buffers a collective leaves behind until the next one's wait, `Lingering`). They
differ in one parameter each, and for a reason:

  - ``held``: tangents are alive from the start of the backward walks; the forward has none.
  - ``resident``: storage alive for the whole walk, counted once up front. The backward walks add
    the forward outputs to the parameters and inputs: the caller holds them through the backward.
  - ``forward_storage``: whether a backward value that is a view of a forward value counts that
    forward value's storage. The ILP counts it (``True``): its model must over-approximate the
    simulator, and its variables stop counting a forward value once no stage reads it, while the
    view may keep it alive longer. The instant program does not (``False``): its fixed part must
    under-approximate every schedule, and it counts forward storage in its own variables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence

from fxopt.solvers.graph import Graph

# A storage: (node whose ``bytes`` it has, which copy). The profiles use copy 0 of each root; the
# simulator numbers the copies a recomputation makes.
Key = tuple[int, int]


class LiveBytes:
    """Reference counts on storage, and the bytes of the storage something refers to."""

    def __init__(self, graph: Graph, base: int = 0):
        self._nodes = graph.nodes
        self._refs: dict[Hashable, int] = {}
        self.bytes = base

    def hold(self, key: Hashable, size: int | None = None) -> None:
        """One more reference to storage ``key``: a `Key`, of its node's bytes, or any other name
        with its ``size`` (the simulator's compressed encodings)."""
        if self._refs.get(key, 0) == 0:
            self.bytes += self._nodes[key[0]].bytes if size is None else size
        self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, key: Hashable, size: int | None = None) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.bytes -= self._nodes[key[0]].bytes if size is None else size

    def is_held(self, key: Hashable) -> bool:
        return self._refs.get(key, 0) > 0


class Lingering:
    """Collectives' buffers freed late (`fxopt.solvers.graph.Node.lingers`, gloo's copy of a
    reduce-scatter's input), on ``memory``: node i's are held from just after it runs until the
    wait of the next collective that lingers has run, or to the end of the walk (`release_all`).
    One rule for the simulator and the profiles, so that the fixed memory the ILP and the instant
    program count holds them where every schedule does: the backward nodes that linger, and their
    waits, run once and in order whatever is recomputed between them.

    ``exact``: held from just after node i runs until its own wait (its users) has run, no
    longer. The rewritten step frees gloo's copy there (`fxopt.ops.collectives`: the wait returns
    once gloo's worker thread has let go of it), so the rule above is an upper bound of it; the
    simulator counts exactly where a step waits for a reduce-scatter later than where it was
    traced (`fxopt.solvers.prefetch.prefetched`), as the waits were moved within the room that
    bound leaves (it holds each copy, in graph order, at least to its own wait)."""

    def __init__(self, graph: Graph, memory: LiveBytes, exact: bool = False):
        self._graph, self._memory = graph, memory
        self.exact = exact
        # [key, bytes, the waits of the next lingering node that free it (None until it runs; an
        # empty set once one has run), its own waits not run yet]
        self._held: list[list] = []
        self._watched: set[int] = set()  # the nodes whose run may free something held
        self._made = 0

    def after(self, i: int) -> None:
        """Node ``i`` has run: free what lingered until it, and hold its own."""
        if i in self._watched:
            for entry in self._held:
                if entry[2] is not None and i in entry[2]:
                    entry[2] = frozenset()
                entry[3].discard(i)
            for entry in [e for e in self._held if (self.exact or e[2] == frozenset()) and not e[3]]:
                self._memory.release(entry[0], entry[1])
                self._held.remove(entry)
        nbytes = self._graph.nodes[i].lingers
        if nbytes:
            waits = frozenset(self._graph.users[i]) or frozenset({i})
            for entry in self._held:
                if entry[2] is None:
                    entry[2] = waits
            self._watched.update(waits, self._graph.users[i])
            self._made += 1
            key = ("lingers", i, self._made)
            self._memory.hold(key, nbytes)
            self._held.append([key, nbytes, None, set(self._graph.users[i])])

    def release_all(self) -> None:
        """The walk has ended: whatever still lingers is freed (by the time the step returns)."""
        for key, nbytes, _, _ in self._held:
            self._memory.release(key, nbytes)
        self._held.clear()


def last_uses(reads: Iterable[Iterable[Hashable]]) -> dict[Hashable, int]:
    """For step reads (what each step reads, in order), the last step reading each value."""
    last: dict[Hashable, int] = {}
    for step, values in enumerate(reads):
        for value in values:
            last[value] = step
    return last


@dataclasses.dataclass(frozen=True)
class Profile:
    start: int  # bytes alive before the first step: resident and held values
    before: list[int]  # bytes alive as step k starts, before it allocates
    during: list[int]  # bytes alive while step k runs: its value and workspace included
    lifetimes: dict[int, tuple[int, int]]  # counted root -> (first step, last step) it is alive; past the end: len(order)


def profile(graph: Graph, order: Sequence[int], *, resident: Iterable[int], held: Iterable[int] = (),
            forward_storage: bool = True) -> Profile:
    """Walk ``order`` (each node once): a node's value holds its root's storage from its step to
    the last step reading it, outputs for good. ``resident``: values whose storage is alive for the
    whole walk, counted once; ``held``: values alive from the start and for good; with
    ``forward_storage=False`` storage owned by a forward value is not counted (see the module)."""
    nodes = graph.nodes
    resident_roots = {graph.roots[i] for i in resident}
    memory = LiveBytes(graph, base=sum(nodes[r].bytes for r in resident_roots))

    def counted(i: int) -> Key | None:
        r = graph.roots[i]
        if r in resident_roots or (not forward_storage and nodes[r].kind == "forward"):
            return None
        return (r, 0)

    def hold(i: int) -> None:
        if (key := counted(i)) is not None:
            memory.hold(key)

    for i in held:
        hold(i)
    pos = {i: k for k, i in enumerate(order)}
    last = last_uses([j for j in nodes[i].inputs if j in pos] for i in order)
    dying: dict[int, list[int]] = {}
    for i in order:
        if not nodes[i].output:
            dying.setdefault(max(last.get(i, pos[i]), pos[i]), []).append(i)
    lingering = Lingering(graph, memory)
    start = memory.bytes
    before, during = [], []
    first: dict[int, int] = {}
    end: dict[int, int] = {}
    for k, i in enumerate(order):
        before.append(memory.bytes)
        hold(i)
        if (key := counted(i)) is not None:
            first.setdefault(key[0], k)
            end.pop(key[0], None)  # alive again (a view made after its storage was let go)
        during.append(memory.bytes + nodes[i].workspace)
        for j in dying.get(k, ()):
            key = counted(j)
            if key is not None:
                memory.release(key)
                if not memory.is_held(key):
                    end[key[0]] = k
        lingering.after(i)
    return Profile(start, before, during, {r: (k, end.get(r, len(order))) for r, k in first.items()})


def forward_profile(graph: Graph, order: Sequence[int]) -> Profile:
    """The forward ``order`` with nothing SAVEd: what every schedule's forward holds at least."""
    return profile(graph, order, resident=graph.resident)


def backward_profile(graph: Graph) -> Profile:
    """The backward nodes, with forward values only where a backward view keeps their storage:
    resident values and forward outputs, tangents, the backward values alive at each node."""
    return profile(graph, graph.backward_nodes, resident=graph.resident | graph.forward_outputs,
                   held=[i for i, n in enumerate(graph.nodes) if n.tangent])


def fixed_backward_profile(graph: Graph) -> Profile:
    """The backward nodes' walk that every schedule holds, forward values aside: resident values
    and forward outputs, tangents, the backward values alive. A backward value that shares a
    forward value's storage counts nothing here (that storage is counted as a forward value)."""
    return profile(graph, graph.backward_nodes, resident=graph.resident | graph.forward_outputs,
                   held=[i for i, n in enumerate(graph.nodes) if n.tangent], forward_storage=False)


def fixed_backward_bytes(graph: Graph) -> list[int]:
    """For each backward node k, the bytes every schedule holds while it runs, forward values
    aside (`fixed_backward_profile`), k's value and workspace included."""
    return fixed_backward_profile(graph).during
