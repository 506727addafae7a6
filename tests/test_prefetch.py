"""Re-gathers issued ahead of their wait and priced by their exposed time (`fxopt.solvers.prefetch`),
on hand-built sharded steps (no tensors, no process group)."""

from __future__ import annotations

import pytest

from fxopt.solvers import solve
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.minimum import Memo
from fxopt.solvers.prefetch import prefetched, priced
from fxopt.solvers.schedule import Schedule, as_generated, forward_order, simulate

RATE = 1e9  # bytes per second the process group moves (gloo's, `fxopt.analysis.costs`)
COMM = 10_000 / RATE  # seconds to gather ``w`` again: 1e-5


def sharded_step(hiding_seconds: float, *, overlap: bool = True) -> Graph:
    """One gathered parameter ``w`` (10,000 bytes received: 1e-5 s of communication) and one
    activation ``a`` (a MFLOP, 5e-6 s to recompute: half the communication), both read by the
    backward's last two nodes. Before them: ``g1`` (300 bytes, 2e-5 s), ``g2``, and ``g3`` (4 bytes,
    ``hiding_seconds`` of compute), behind which a re-gather can run. A budget of 540 B holds one
    of ``w`` and ``a`` beside ``g1``, not both; beside ``g3`` both fit. ``overlap`` False: ``w``
    priced as before prefetch, its whole communication in its cost."""
    gather = (Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM,
                   comm_seconds=COMM, comm_exposed=COMM) if overlap else
              Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM))
    graph = Graph((
        Node("shard", "input", bytes=25),
        Node("x", "input", bytes=100),
        gather,
        Node("a", "forward", inputs=(1,), bytes=100, flops=10**6, cost=5e-6),
        Node("loss", "forward", inputs=(2, 3), bytes=4, flops=100, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("g1", "backward", inputs=(5,), bytes=300, flops=100, cost=2e-5),
        Node("g2", "backward", inputs=(6,), bytes=4, flops=100, cost=1e-6),
        Node("g3", "backward", inputs=(7,), bytes=4, flops=100, cost=hiding_seconds),
        Node("gw", "backward", inputs=(8, 2), bytes=4, flops=100, cost=1e-6, output=True),
        Node("gx", "backward", inputs=(8, 3), bytes=4, flops=100, cost=1e-6, output=True),
    ))
    return priced(graph) if overlap else graph


W, A, G1, G2, G3, GW, GX = 2, 3, 6, 7, 8, 9, 10


@pytest.mark.parametrize("overlap, hiding, flops, regathered", [
    (False, 2e-5, 10**6, 0),       # raw price: 1e-5 s to re-gather against 5e-6 s to recompute: recompute
    (True, 2e-5, 0, 10_000),       # hidden behind the backward's compute: re-gather, no FLOPs
])
def test_a_hidden_regather_is_priced_below_its_communication_and_chosen(overlap, hiding, flops, regathered):
    """Fails before prefetch: ``w``'s re-gather cost its whole communication (1e-5 s), twice
    recomputing ``a``, so the solver recomputed ``a`` at 540 B. Issued before ``g3`` (2e-5 s of
    compute) its wait never stands still: priced at its issue's 1e-7 s, it is the plan."""
    graph = sharded_step(hiding, overlap=overlap)
    s = solve(graph, 540, "auto", memo=Memo())
    assert s.timeline.peak_bytes <= 540
    assert (s.timeline.recompute_flops, s.timeline.recompute_comm_bytes) == (flops, regathered)
    if overlap:
        assert graph.nodes[W].cost == pytest.approx(1e-7) and graph.nodes[W].comm_exposed == 0.0
        assert s.timeline.exposed_comm_seconds == 0.0
        order = as_generated(graph, s.schedule, prefetch=True).backward
        assert order.index(W) == order.index(G3) - 1  # issued right before the compute that hides it


def test_the_simulator_counts_the_prefetched_buffer_and_the_wait_left():
    """Re-gathering ``w`` before ``gw``: the generated step issues it before ``g3``, so ``w``'s 100 B
    are live while ``g3`` runs (the simulator's event there holds them), and the wait stands still
    for what ``g3`` does not hide: nothing behind 2e-5 s, 1e-5 - 4e-6 behind 4e-6 s. Before ``g1``
    (where ``g1``'s 2e-5 s would hide it all) it would raise the step's peak: never so far."""
    for hiding, exposed in ((2e-5, 0.0), (4e-6, COMM - 4e-6 - 1e-7)):  # (the issue computes 1e-7 s beside it)
        graph = sharded_step(hiding)
        schedule = Schedule(frozenset({A}), (G1, G2, G3, W, GW, GX))
        assert prefetched(graph, schedule.backward)[:3] == ((W, G1, G2) if hiding < COMM else (G1, G2, W))
        assert as_generated(graph, schedule, prefetch=True).backward == (G1, G2, W, G3, GW, GX)
        assert simulate(graph, schedule).peak_bytes == simulate(graph, schedule, prefetch=False).peak_bytes
        timeline = simulate(graph, schedule)
        live = {name: b for phase, name, b in timeline.events if phase == "backward"}
        # at g3: shard, x, t, loss, a, g2, g3 and the prefetched w
        assert live["g3"] == 25 + 100 + 4 + 4 + 100 + 4 + 4 + 100
        assert timeline.exposed_comm_seconds == pytest.approx(exposed)
        assert timeline.cost == pytest.approx(timeline.recompute_cost + exposed)
        assert timeline.recompute_cost == pytest.approx(1e-7)  # the issue's compute; the wait apart


def test_a_regather_read_at_the_backwards_start_cannot_hide():
    """The price before any plan (`priced`) is the communication less the backward's compute
    before the first backward reader: a parameter the first backward node reads is priced whole."""
    graph = priced(Graph((
        Node("shard", "input", bytes=25),
        Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM,
             comm_seconds=COMM, comm_exposed=COMM),
        Node("loss", "forward", inputs=(1,), bytes=4, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("gw", "backward", inputs=(3, 1), bytes=4, cost=3e-6, output=True),
    )))
    assert graph.nodes[1].comm_exposed == pytest.approx(COMM)
    assert graph.nodes[1].cost == pytest.approx(1e-7 + COMM)
    timeline = simulate(graph, Schedule(frozenset(), (1, 4)))
    assert timeline.exposed_comm_seconds == pytest.approx(COMM - 1e-7)  # (less its issue's own compute)


def test_two_regathers_share_the_process_group_one_at_a_time():
    """Two re-gathers read by the same node behind 2.5e-5 s of compute: issued so that the second
    ends at the read and the first ends where the second begins, both hidden; behind 1.5e-5 s the
    process group cannot finish both (2e-5 s of communication): 5e-6 s exposed."""
    for hiding, exposed in ((2.5e-5, 0.0), (1.5e-5, 5e-6)):
        graph = priced(Graph((
            Node("s1", "input", bytes=25),
            Node("s2", "input", bytes=25),
            Node("w1", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=COMM, comm_seconds=COMM,
                 comm_exposed=COMM),
            Node("w2", "forward", inputs=(1,), bytes=100, comm_bytes=10_000, cost=COMM, comm_seconds=COMM,
                 comm_exposed=COMM),
            Node("loss", "forward", inputs=(2, 3), bytes=4, cost=1e-6, output=True),
            Node("t", "input", bytes=4, tangent=True),
            Node("g1", "backward", inputs=(5,), bytes=4, cost=hiding / 2),
            Node("g2", "backward", inputs=(6,), bytes=4, cost=hiding / 2),
            Node("gw", "backward", inputs=(7, 2, 3), bytes=4, cost=1e-6, output=True),
        )))
        timeline = simulate(graph, Schedule(frozenset(), (6, 7, 2, 3, 8)))
        assert timeline.exposed_comm_seconds == pytest.approx(exposed)


def test_a_regather_is_never_issued_between_a_tuple_and_its_outputs():
    """The generated code takes a multi-output op's outputs out right after it: a re-gather whose
    hiding point falls among them is issued after them instead (here: not moved at all)."""
    graph = priced(Graph((
        Node("shard", "input", bytes=25),
        Node("x", "input", bytes=100),
        Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM, comm_seconds=COMM,
             comm_exposed=COMM),
        Node("ln", "forward", inputs=(1,), bytes=0, cost=1e-6, tensor=False),
        Node("ln0", "forward", inputs=(3,), bytes=100, cost=1e-5),
        Node("ln1", "forward", inputs=(3,), bytes=4, cost=1e-6),
        Node("loss", "forward", inputs=(2, 4, 5), bytes=4, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("g", "backward", inputs=(7,), bytes=4, cost=1e-6),
        Node("gw", "backward", inputs=(8, 2, 4, 5), bytes=4, cost=1e-6, output=True),
    )))
    backward = (8, 3, 4, 5, 2, 9)  # g, ln recomputed with its two outputs, the re-gather of w, gw
    assert prefetched(graph, backward) == backward
    timeline = simulate(graph, Schedule(frozenset(), backward))
    assert timeline.exposed_comm_seconds == pytest.approx(COMM - 1e-7)  # (issued where it was: only its issue hides it)


def step_with_a_reduce_scatter(before: float, after: float) -> Graph:
    """``w`` gathered again for ``gw``, and between the backward's compute ``g1`` (``before``
    seconds) and ``g3`` (``after``) a gradient's reduce-scatter ``rs``, waited where issued: it
    holds the process group for 1e-5 s (`holds_group`), the re-gather's own communication time."""
    return priced(Graph((
        Node("shard", "input", bytes=25),
        Node("w", "forward", inputs=(0,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM, comm_seconds=COMM,
             comm_exposed=COMM),
        Node("loss", "forward", inputs=(1,), bytes=4, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("g1", "backward", inputs=(3,), bytes=4, cost=before),
        Node("rs", "backward", inputs=(4,), bytes=4, comm_bytes=10_000, cost=COMM, comm_seconds=COMM, output=True),
        Node("g3", "backward", inputs=(4,), bytes=4, cost=after),
        Node("gw", "backward", inputs=(6, 1), bytes=4, cost=1e-6, output=True),
    )))


W1, G1_, RS, G3_, GW_ = 1, 4, 5, 6, 7


def test_a_reduce_scatter_queues_behind_a_regather_in_flight():
    """The process group runs one collective at a time, in the order issued: a re-gather issued
    just before a reduce-scatter (waited where issued) makes the step stand still for the rest of
    the gather first. Before, the simulator ran the two side by side and called the gather hidden."""
    graph = step_with_a_reduce_scatter(2e-5, 2e-5)
    timeline = simulate(graph, Schedule(frozenset(), (G1_, W1, RS, G3_, GW_)), prefetch=False)
    assert timeline.exposed_comm_seconds == pytest.approx(COMM - 1e-7)  # (the issue's own compute beside it)
    alone = simulate(graph, Schedule(frozenset(), (G1_, RS, W1, G3_, GW_)), prefetch=False)
    assert alone.exposed_comm_seconds == 0.0  # issued after it, behind g3's 2e-5 s


@pytest.mark.parametrize("before, after, order", [
    (2e-5, 2e-5, (G1_, RS, W1, G3_, GW_)),  # the latest stretch that holds it: after the reduce-scatter
    (2e-5, 5e-6, (W1, G1_, RS, G3_, GW_)),  # after it too short: before it, done before it is issued
])
def test_a_regather_is_issued_between_the_reduce_scatters(before, after, order):
    """Fails before: the re-gather went back from its wait as far as its communication takes,
    across the reduce-scatter whenever what follows it is too short, and delayed it."""
    graph = step_with_a_reduce_scatter(before, after)
    schedule = Schedule(frozenset(), (G1_, RS, G3_, W1, GW_))
    assert as_generated(graph, schedule, prefetch=True).backward == order
    assert simulate(graph, schedule).exposed_comm_seconds == 0.0


def test_a_regather_is_priced_by_the_longest_stretch_between_reduce_scatters():
    """Before any plan (`priced`), a re-gather hides behind the longest stretch of backward compute
    between the collectives that hold the process group, not behind all of it."""
    graph = step_with_a_reduce_scatter(4e-6, 3e-6)
    assert graph.nodes[W1].comm_exposed == pytest.approx(COMM - 4e-6)


def two_block_forward(hiding: float, scratch: int = 0) -> Graph:
    """A forward of two blocks, each gathering its weight (``w1``, ``w2``: 10,000 bytes received,
    1e-5 s of communication) before its product (``h1``: ``hiding`` seconds of compute and
    ``scratch`` bytes of scratch memory; ``h2``). In graph order, as captured, ``w2`` is gathered
    after ``h1`` and waited for at once."""
    def gather(name, shard):
        return Node(name, "forward", inputs=(shard,), bytes=100, comm_bytes=10_000, cost=1e-7 + COMM,
                    comm_seconds=COMM, comm_exposed=COMM)

    return priced(Graph((
        Node("s1", "input", bytes=25), Node("s2", "input", bytes=25), Node("x", "input", bytes=100),
        gather("w1", 0),
        Node("h1", "forward", inputs=(2, 3), bytes=100, flops=100, cost=hiding, workspace=scratch),
        gather("w2", 1),
        Node("h2", "forward", inputs=(4, 5), bytes=100, flops=100, cost=1e-6),
        Node("loss", "forward", inputs=(6,), bytes=4, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node("gh2", "backward", inputs=(8, 5), bytes=100, cost=1e-6),
        Node("gw2", "backward", inputs=(8, 4), bytes=4, cost=1e-6, output=True),
        Node("gw1", "backward", inputs=(9, 3, 2), bytes=4, cost=1e-6, output=True),
    )))


W1F, H1F, W2F, H2F = 3, 4, 5, 6
SAVE_BOTH = Schedule(frozenset({3, 4, 5}), (9, 10, 11))


def test_the_next_blocks_gather_is_issued_during_this_blocks_compute():
    """Fails before: the forward ran in graph order, each all-gather waited for where issued, so
    ``w2``'s communication (1e-5 s) stood still after ``h1``. Issued before ``h1`` (2e-5 s of
    compute) it is hidden: the forward waits only for the first gather (nothing before it to hide
    behind: 1e-5 s less the two issues' compute). The simulator holds ``w2``'s 100 B while ``h1`` runs,
    and the peak is the same."""
    graph = two_block_forward(2e-5)
    assert forward_order(graph, SAVE_BOTH) == [W1F, W2F, H1F, H2F, 7]
    ahead, waited = simulate(graph, SAVE_BOTH), simulate(graph, SAVE_BOTH, prefetch=False)
    live = {name: b for phase, name, b in ahead.events if phase == "forward"}
    assert live["h1"] == 25 + 25 + 100 + 100 + 100 + 100  # shards, x, w1, h1 and the gathered w2
    assert ahead.forward_exposed_comm_seconds == pytest.approx(COMM - 2e-7)
    assert waited.forward_exposed_comm_seconds == pytest.approx(2 * COMM)
    assert ahead.peak_bytes == waited.peak_bytes


def test_a_forward_gather_is_not_issued_across_a_step_it_would_raise_above_the_peak():
    """``h1`` holds 2,000 bytes of scratch: the step's peak is there, and ``w2`` gathered across
    it would raise it. It stays after ``h1``, waited for there (its communication exposed)."""
    graph = two_block_forward(2e-5, scratch=2000)
    assert forward_order(graph, SAVE_BOTH) == [W1F, H1F, W2F, H2F, 7]
    ahead, waited = simulate(graph, SAVE_BOTH), simulate(graph, SAVE_BOTH, prefetch=False)
    assert ahead.peak_bytes == waited.peak_bytes
    assert ahead.forward_exposed_comm_seconds == pytest.approx(2 * COMM)  # (the step as captured)


def test_forward_gathers_share_the_process_group_one_at_a_time():
    """Behind 4e-6 s of ``h1`` the gather of ``w2`` cannot hide: it is issued with ``w1``'s, queued
    behind it on the process group (1e-5 s each), and ``h2`` waits for the rest."""
    graph = two_block_forward(4e-6)
    assert forward_order(graph, SAVE_BOTH) == [W1F, W2F, H1F, H2F, 7]
    ahead = simulate(graph, SAVE_BOTH)
    # w1 waited for by h1 (1e-5 less w1's and w2's issues); w2 ends 1e-5 later, h1 hides 4e-6 of it
    assert ahead.forward_exposed_comm_seconds == pytest.approx(2 * COMM - 2e-7 - 4e-6)


def scatter(name: str, gradient: int, **fields) -> Node:
    """A gradient's reduce-scatter over 2 ranks (gloo): its shard 200 B, the whole gradient's 400 B
    copy gloo reduces in (`Node.lingers`), 1e-5 s of communication."""
    return Node(name, "backward", inputs=(gradient,), bytes=200, comm_bytes=10_000, cost=COMM, comm_seconds=COMM,
                lingers=400, **fields)


def wait(name: str, collective: int, **fields) -> Node:
    return Node(name, "backward", inputs=(collective,), storage=collective, cost=1e-7, **fields)


def _reduced_step(g: str, *rest: Node) -> Graph:
    """A step whose backward starts with one 400 B gradient: ``x`` (0, 100 B), ``h`` (1, 100 B,
    SAVEd in the schedules here), ``loss`` (2), the incoming gradient ``t`` (3), the gradient
    ``g`` (4, from ``t`` and ``h``), then ``rest`` (from index 5)."""
    return Graph((
        Node("x", "input", bytes=100),
        Node("h", "forward", inputs=(0,), bytes=100, cost=1e-6),
        Node("loss", "forward", inputs=(1,), bytes=4, cost=1e-6, output=True),
        Node("t", "input", bytes=4, tangent=True),
        Node(g, "backward", inputs=(3, 1), bytes=400, cost=1e-6),
        *rest,
    ))


def _generated_order(graph: Graph, schedule: Schedule) -> list[str]:
    """The names of the generated code's backward steps, waits moved (`as_generated`)."""
    return [graph.nodes[i].name for i in as_generated(graph, schedule, prefetch=True).backward]


def _with_and_without_moves(graph: Graph, schedule: Schedule):
    """The simulated step with its waits moved, and with each waited for where it is issued."""
    return simulate(graph, schedule), simulate(graph, schedule, prefetch=False)


def _backward_live(timeline) -> list[tuple[str, int]]:
    """(step, bytes live after it) for each backward step of ``timeline``."""
    return [(name, live) for phase, name, live in timeline.events if phase == "backward"]


def test_a_reduce_scatters_copy_is_counted_from_its_issue_to_its_wait_moved_later():
    """Fails before: each reduce-scatter was waited for where issued, its 1e-5 s standing the
    backward still. Now its wait moves to just before the first step that reads what it returns
    (``cast``: mixed precision's), behind ``gh``'s 2e-5 s of compute, which hides it. The simulator
    counts gloo's 400 B copy of the whole gradient from the issue to that wait, and no longer (the
    rewritten step frees it there, `fxopt.ops.collectives.reduce_scatter_wait`); without the move
    the schedule holds it to the step's end (`fxopt.solvers.liveness.Lingering`, an upper bound
    where the wait is where it was issued), so the peak is lower with it here, never higher."""
    graph = _reduced_step(
        "g",
        scatter("rs", 4),
        wait("w", 5),
        Node("gh", "backward", inputs=(3, 0), bytes=100, cost=2e-5),
        Node("gx", "backward", inputs=(7,), bytes=100, cost=1e-6, output=True),
        Node("cast", "backward", inputs=(6,), bytes=200, cost=1e-7, output=True),
    )
    schedule = Schedule(frozenset({1}), (4, 5, 6, 7, 8, 9))
    assert _generated_order(graph, schedule) == ["g", "rs", "gh", "gx", "w", "cast"]
    later, at_once = _with_and_without_moves(graph, schedule)
    # x 100, loss 4, t 4, the shard 200, and the copy 400 from ``rs`` through ``w``
    assert _backward_live(later) == [
        ("<start>", 208), ("g", 608), ("rs", 708), ("gh", 808), ("gx", 908), ("w", 808), ("cast", 608)]
    assert later.peak_bytes == 908 < at_once.peak_bytes == 1008  # (``cast`` with the copy, held to the end)
    assert later.reduce_exposed_comm_seconds == 0.0 and at_once.reduce_exposed_comm_seconds == pytest.approx(COMM)
    assert later.cost == at_once.cost  # (not part of a plan's cost: every plan reduces every gradient)


def test_a_reduce_scatters_wait_is_not_moved_across_a_step_it_would_raise_above_the_peak():
    """``rs1``'s copy is held by the schedule without the move (`Lingering`) until ``rs2``'s wait,
    so its wait moves there for nothing; past it, across ``big`` (1,908 B: x, loss, t, the two
    shards, ``rs2``'s copy and ``big``; the peak, 2,008 B, is ``gx``'s), its 400 B would raise the
    peak, so it stops before ``big``. ``rs2``'s copy is held to the end anyway: its wait goes to the end. The
    order is the generated code's (`fxopt.passes.recompute`), the same on every rank."""
    graph = _reduced_step(
        "g1",
        scatter("rs1", 4),
        wait("w1", 5, output=True),
        Node("g2", "backward", inputs=(3, 0), bytes=400, cost=1e-6),
        scatter("rs2", 7),
        wait("w2", 8, output=True),
        Node("big", "backward", inputs=(3,), bytes=1000, cost=1e-5),
        Node("gx", "backward", inputs=(10,), bytes=100, cost=1e-6, output=True),
    )
    schedule = Schedule(frozenset({1}), (4, 5, 6, 7, 8, 9, 10, 11))
    assert _generated_order(graph, schedule) == ["g1", "rs1", "g2", "rs2", "w1", "big", "gx", "w2"]
    later, at_once = _with_and_without_moves(graph, schedule)
    assert later.peak_bytes == at_once.peak_bytes == 2008
    assert [live for _, name, live in later.events if name == "big"] == [1908]
    assert later.reduce_exposed_comm_seconds < at_once.reduce_exposed_comm_seconds == pytest.approx(2 * COMM)


def test_a_reduce_scatters_wait_moves_with_the_cast_that_reads_it():
    """Fails before: mixed precision's cast of the reduced shard to the shard's dtype (``cast``:
    the 200 B bf16 shard to a 400 B float32 one) read the wait right after it, so the wait stayed
    where it was issued and the backward stood still for the whole reduce-scatter. Now the cast
    moves with the wait (`fxopt.solvers.prefetch._followers`), behind ``gh``'s 2e-5 s, to the
    end: nothing reads it but the step's outputs. ``gh`` and ``gx`` then hold the 200 B shard, not
    the 400 B cast, and the cast runs after the wait has let go of gloo's 400 B copy: the peak is
    ``gx``'s, 908 B (x, loss, t, the shard, the copy, ``gh``, ``gx``) against 1,108 with the cast
    and the copy (held to the end, `Lingering`) there."""
    graph = _reduced_step(
        "g",
        scatter("rs", 4),
        wait("w", 5),
        Node("cast", "backward", inputs=(6,), bytes=400, cost=1e-7, output=True),
        Node("gh", "backward", inputs=(3, 0), bytes=100, cost=2e-5),
        Node("gx", "backward", inputs=(8,), bytes=100, cost=1e-6, output=True),
    )
    schedule = Schedule(frozenset({1}), (4, 5, 6, 7, 8, 9))
    assert _generated_order(graph, schedule) == ["g", "rs", "gh", "gx", "w", "cast"]
    later, at_once = _with_and_without_moves(graph, schedule)
    assert _backward_live(later) == [
        ("<start>", 208), ("g", 608), ("rs", 708), ("gh", 808), ("gx", 908), ("w", 808), ("cast", 808)]
    assert later.peak_bytes == 908 < at_once.peak_bytes == 1108
    assert later.reduce_exposed_comm_seconds == 0.0 and at_once.reduce_exposed_comm_seconds == pytest.approx(COMM)


def test_a_wait_and_its_cast_cross_no_step_they_would_raise_above_the_peak():
    """A cast to a smaller dtype (the 200 B float32 shard to a 100 B bf16 one): each step the wait
    and its cast move across holds the shard, not the cast, 100 B more. ``big`` is the peak
    (1,708 B): they are not moved across it, nor right before it (`_wait_points`' margin); they
    move across ``gh`` alone. The peak falls all the same: the moved wait lets go of gloo's 400 B
    copy there (`Lingering.exact`), which the schedule without the move holds to the end (the
    bound the move is checked against)."""
    graph = _reduced_step(
        "g",
        scatter("rs", 4),
        wait("w", 5),
        Node("cast", "backward", inputs=(6,), bytes=100, cost=1e-7, output=True),
        Node("gh", "backward", inputs=(3, 0), bytes=100, cost=2e-5),
        Node("gh2", "backward", inputs=(8,), bytes=100, cost=1e-6),
        Node("big", "backward", inputs=(9,), bytes=1000, cost=2e-5),
        Node("gx", "backward", inputs=(10,), bytes=4, cost=1e-6, output=True),
    )
    schedule = Schedule(frozenset({1}), (4, 5, 6, 7, 8, 9, 10, 11))
    assert _generated_order(graph, schedule) == ["g", "rs", "gh", "w", "cast", "gh2", "big", "gx"]
    later, at_once = _with_and_without_moves(graph, schedule)
    assert _backward_live(later) == [
        ("<start>", 208), ("g", 608), ("rs", 708), ("gh", 808), ("w", 808), ("cast", 508), ("gh2", 408),
        ("big", 1308), ("gx", 1212)]
    assert later.peak_bytes == 1308 < at_once.peak_bytes == 1708


def test_the_plans_summary_says_how_long_the_step_waits_for_communication():
    """The seconds the step waits for its collectives (the simulator's, `Timeline`), in the plan
    (`Plan.forward_exposed_comm_seconds`, `exposed_comm_seconds`, `reduce_exposed_comm_seconds`),
    its summary and ``fxopt inspect``'s, kept through JSON; a step without collectives says
    nothing of it (and its JSON has no such keys)."""
    import argparse
    import io

    from rich.console import Console

    from fxopt.cli.main import _print_summary
    from fxopt.solvers.plan import Plan

    graph = sharded_step(2e-5)
    schedule = Schedule(frozenset({A}), (G1, G2, G3, W, GW, GX))  # (``w`` gathered again: 4e-6 of it exposed)
    plan = Plan.build(graph=graph, schedule=schedule, budget_bytes=10**4, eager_peak_bytes=10**4, solver="test",
                      status="feasible", solve_seconds=0.0, fingerprint="")
    timeline = simulate(graph, schedule)
    assert plan.reduce_exposed_comm_seconds == timeline.reduce_exposed_comm_seconds == 0.0
    assert plan.forward_exposed_comm_seconds == timeline.forward_exposed_comm_seconds == pytest.approx(COMM)
    words = (f"waits for communication {1e3 * (COMM + plan.exposed_comm_seconds):.2f} ms (simulated: forward "
             f"all-gathers {1e3 * COMM:.2f}, re-gathers {1e3 * plan.exposed_comm_seconds:.2f}, gradient reductions 0.00)")
    assert words in plan.summary() and words in Plan.from_json(plan.to_json()).summary()
    out = io.StringIO()
    _print_summary(Console(file=out, width=300), plan, argparse.Namespace(budget="10000"), 0.0, {}, None)
    assert words in out.getvalue()
    alone = Graph(tuple(n.replaced(comm_seconds=0.0, comm_exposed=0.0, comm_bytes=0) for n in graph.nodes))
    plain = Plan.build(graph=alone, schedule=schedule, budget_bytes=10**4, eager_peak_bytes=10**4, solver="test",
                       status="feasible", solve_seconds=0.0, fingerprint="")
    assert "communication" not in plain.summary()
    assert not {"exposed_comm_seconds", "forward_exposed_comm_seconds", "reduce_exposed_comm_seconds"} & plain.to_dict().keys()


def test_an_all_reduces_wait_moves_to_its_first_reader_in_the_simulator_too():
    """Fails before: the simulator waited for each of DDP's all-reduces where it was issued (its
    1e-5 s standing the backward still) while the generated code waited before its first reader
    (`fxopt.passes.waits.sink_all_reduce_waits`). Now the simulator's order is the generated
    code's: the wait goes to the end (nothing reads the gradient but the step's outputs), behind
    ``gh``'s 2e-5 s, which hides it. An all-reduce holds nothing in flight but the output it made
    at its issue (no `Node.lingers`): the same bytes at every step."""
    graph = _reduced_step(
        "g",
        Node("ar", "backward", inputs=(4,), bytes=400, comm_bytes=10_000, cost=COMM, comm_seconds=COMM),
        wait("w", 5, output=True),
        Node("gh", "backward", inputs=(3, 0), bytes=100, cost=2e-5),
        Node("gx", "backward", inputs=(7,), bytes=100, cost=1e-6, output=True),
    )
    schedule = Schedule(frozenset({1}), (4, 5, 6, 7, 8))
    assert _generated_order(graph, schedule) == ["g", "ar", "gh", "gx", "w"]
    later, at_once = _with_and_without_moves(graph, schedule)
    # (x, loss, t, and the all-reduce's 400 B output from its issue; the wait makes nothing)
    assert _backward_live(later) == [
        ("<start>", 208), ("g", 608), ("ar", 908), ("gh", 608), ("gx", 708), ("w", 608)]
    assert _backward_live(at_once) == [
        ("<start>", 208), ("g", 608), ("ar", 908), ("w", 508), ("gh", 608), ("gx", 708)]
    assert later.peak_bytes == at_once.peak_bytes == 908
    assert later.reduce_exposed_comm_seconds == 0.0 and at_once.reduce_exposed_comm_seconds == pytest.approx(COMM)
