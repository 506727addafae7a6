"""COMPRESS: codecs, the simulator's and the ILP's view of compressed values, and end to end
(lossless: bit-identical gradients; lossy: measured error)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.analysis.codecs import Quantize
from fxopt.measure import sqnr_db
from fxopt.solvers import Graph, Node, Schedule, simulate, solve
from fxopt.solvers.ilp import solve_ilp
from helpers import assert_same_step, measured_peak, run_pair, step

ops = torch.ops.fxopt


@pytest.mark.parametrize("shape", [(4096,), (33, 129)])
def test_bits_round_trip_exactly(shape):
    m = torch.rand(shape) > 0.5
    packed = ops.pack_bits(m, 0.0, 0)
    assert packed.numel() == (m.numel() + 7) // 8
    assert torch.equal(ops.unpack_bits(packed, list(shape)), m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q, floor_db", [
    (Quantize("int8"), 40), (Quantize("int8", 32, "minmax", True), 38), (Quantize("fp8"), 28),
    (Quantize("int4"), 17), (Quantize("int4", 16, "minmax"), 18),
])
def test_quantize_round_trip_error_and_size(dtype, q, floor_db):
    from fxopt.analysis.codecs import codec_for

    torch.manual_seed(0)
    x = torch.randn(257, 33, dtype=dtype)  # not a multiple of the group size: padded
    codec = codec_for(x, lossless=True, quantize=q)
    buf = codec.compress_op(x, *codec.compress_args)
    y = codec.decompress_op(buf, *codec.decompress_args)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.compressed_bytes
    assert y.dtype == dtype and y.shape == x.shape
    assert sqnr_db(x.float(), y.float()) >= floor_db
    assert codec.compressed_bytes < x.numel() * x.element_size()


def test_quantize_options_are_checked():
    with pytest.raises(ValueError, match="format"):
        Quantize("int3")
    with pytest.raises(ValueError, match="fp8"):
        Quantize("fp8", scaling="minmax")
    with pytest.raises(TypeError, match="quantize"):
        fxopt.optimize(nn.Linear(2, 2), 0.5, quantize=8)


def _chain(codec_cost=1e-6, codec_workspace=0):
    """x -> a -> b -> loss; the backward reads a (compressible 1000 -> 100 bytes) and b."""
    return Graph((
        Node("x", "input", bytes=10),
        Node("a", "forward", (0,), bytes=1000, cost=1.0, codec="test", compressed_bytes=100, codec_cost=codec_cost,
             codec_workspace=codec_workspace),
        Node("b", "forward", (1,), bytes=1000, cost=1.0),
        Node("out", "forward", (2,), bytes=4, cost=0.1, output=True),
        Node("g", "input", bytes=4, tangent=True),
        Node("gb", "backward", (4, 2), bytes=1000, cost=1.0),
        Node("ga", "backward", (5, 1), bytes=10, cost=1.0, output=True),
    ))


def test_simulator_counts_compressed_bytes_and_codec_cost():
    g = _chain()
    assert g.compressible == frozenset({1})
    plain = Schedule(frozenset({1, 2}), (5, 6))
    packed = Schedule(frozenset({1, 2}), (5, 6), frozenset({1}))
    t0, t1 = simulate(g, plain), simulate(g, packed)
    assert t0.saved_bytes - t1.saved_bytes == 900
    assert t1.peak_bytes < t0.peak_bytes
    assert t1.recompute_cost == pytest.approx(1e-6)
    assert any(e[1] == "decompress a" for e in t1.events)
    with pytest.raises(ValueError, match="cannot compress"):
        simulate(g, Schedule(frozenset({2}), (1, 5, 6), frozenset({2})))


def test_decoding_counts_the_encoding_once():
    """While a is decoded for ga, the encoding (held since the forward), the decoded value and the
    codec's scratch are alive, with x, out, the tangent and gb: 10 + 4 + 4 + 1000 + 100 + 1000 + 50
    = 2168 bytes. The simulator once counted the encoding twice there (2268; measured on
    residual_mlp with int8, a step peaked at a decode 168,960 bytes below that count): the ILP's
    plan for 2168, which counts it once, was discarded as over the budget, and `solve` fell back
    on recomputing a (cost 1 instead of 1e-6)."""
    g = _chain(codec_workspace=50)
    packed = Schedule(frozenset({1, 2}), (5, 6), frozenset({1}))
    timeline = simulate(g, packed)
    assert ("backward", "decompress a", 2168) in timeline.events
    assert timeline.peak_bytes == 2168
    res = solve_ilp(g, 2168, time_limit=10)
    assert res.schedule == packed and simulate(g, res.schedule).peak_bytes <= 2168
    assert solve(g, 2168).timeline.recompute_cost == pytest.approx(1e-6)


@pytest.mark.parametrize("codec_cost, expect", [(1e-3, "compress"), (10.0, "recompute")])
def test_ilp_chooses_compress_when_cheaper_than_recompute(codec_cost, expect):
    g = _chain(codec_cost)
    plain = simulate(g, Schedule(frozenset({1, 2}), (5, 6)))
    budget = plain.peak_bytes - 10  # saving a in full no longer fits
    res = solve_ilp(g, budget, time_limit=10)
    t = simulate(g, res.schedule)
    assert t.peak_bytes <= budget
    assert (1 in res.schedule.compressed) == (expect == "compress")
    best = solve(g, budget)
    assert best.timeline.recompute_cost == pytest.approx(min(codec_cost, 1.0))


class ReluDropMLP(nn.Module):
    """ReLU and dropout after every layer: masks everywhere."""

    def __init__(self, width=256, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return x.sum()


def _share_of_save_all(model, inputs, share: float) -> int:
    """``share`` of fxopt's step that recomputes nothing, in bytes: below it something must go
    (a fraction of eager's peak would not do: on CPU eager's dropout keeps float masks, so its
    peak is well above that step's)."""
    return int(share * fxopt.plan(model, 1.0, inputs, solver="save_all", compress=False).peak_bytes)


@pytest.mark.slow
def test_lossless_compression_is_bit_identical_within_budget_and_cheaper():
    torch.manual_seed(0)
    model, inputs = ReluDropMLP(), (torch.randn(512, 256),)
    budget = _share_of_save_all(model, inputs, 0.7)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, time_limit=20)
    assert torch.equal(loss_e, loss_o)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        assert torch.equal(p_e.grad, p_o.grad)
    plan = optimized.plan
    assert plan.compressed and set(plan.compressed.values()) == {"bits"} and not plan.lossy
    assert "COMPRESS" in plan.decisions().values()
    assert measured_peak(optimized, inputs) <= plan.peak_bytes <= plan.budget_bytes
    # Recompute alone needs more extra compute at the same budget.
    without = fxopt.plan(model, plan.budget_bytes, inputs, compress=False, time_limit=20)
    assert not without.compressed
    assert plan.recompute_flops < without.recompute_flops


def test_compress_false_never_compresses_and_replays_only_with_the_same_setting():
    torch.manual_seed(0)
    model, inputs = ReluDropMLP(depth=2), (torch.randn(512, 256),)
    plan = fxopt.plan(model, 0.9, inputs, compress=False)
    assert not plan.compressed
    assert not any(n.name.startswith("where") for n in plan.graph.nodes)  # ReLU's backward untouched
    with pytest.raises(fxopt.CaptureError, match="compress"):
        fxopt.optimize(copy.deepcopy(model), 0.9, plan=plan)(*inputs)


@pytest.mark.slow
def test_int8_on_the_transformer_block():
    from fxopt.models import ZOO

    torch.manual_seed(0)
    model, inputs = ZOO["transformer_block"]()
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, 0.8, quantize="int8", time_limit=20)
    plan = optimized.plan
    assert plan.lossy and all(c.startswith("int8") for c in plan.lossy.values())
    torch.testing.assert_close(loss_o, loss_e)  # the forward is exact: only the backward reads decoded values
    sqnr = fxopt.gradient_sqnr(eager, optimized)
    assert len(sqnr) == len(list(model.parameters()))
    assert min(sqnr.values()) >= 30
    assert measured_peak(optimized, inputs) <= plan.peak_bytes <= plan.budget_bytes


def test_quantize_is_not_used_where_saving_fits():
    torch.manual_seed(0)
    model, inputs = ReluDropMLP(depth=2), (torch.randn(512, 256),)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, 1.0, quantize="int4")
    assert not optimized.plan.lossy
    assert_same_step(eager, optimized, loss_e, loss_o)


@pytest.mark.slow
def test_compression_under_inductor():
    """The codecs are custom ops: Inductor runs them as fallback kernels, keeping the plan."""
    torch.manual_seed(0)
    model, inputs = ReluDropMLP(depth=3), (torch.randn(512, 256),)
    budget = _share_of_save_all(model, inputs, 0.8)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, compiler="inductor", time_limit=20)
    plan = optimized.plan
    assert plan.compressed and not plan.lossy
    torch.testing.assert_close(loss_o, loss_e, rtol=1e-4, atol=1e-4)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):  # Inductor's kernels round differently
        torch.testing.assert_close(p_o.grad, p_e.grad, rtol=1e-4, atol=1e-4)
    assert measured_peak(optimized, inputs) <= plan.budget_bytes


def test_error_amplifying_values_are_not_offered_to_quantization():
    """Log-probabilities (their error is exponentiated by the backward), softmax outputs and
    BatchNorm inputs get no lossy codec; other float activations do."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.bn, self.l2 = nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.l1(x)
            p = torch.softmax(self.l2(torch.relu(self.bn(h))), -1)
            return torch.log_softmax(p * h, -1).mean()

    torch.manual_seed(0)
    plan = fxopt.plan(Net(), 1.0, (torch.randn(512, 64),), quantize="int8")
    codecs = {n.name: n.codec for n in plan.graph.nodes if n.kind == "forward"}
    assert codecs["_log_softmax"] is None and codecs["_softmax"] is None
    assert codecs["addmm"] is None  # BatchNorm's input
    assert codecs["relu"].startswith("int8")


@pytest.mark.parametrize("codec_cost", [1e-3, 10.0])
def test_instant_bound_counts_compression(codec_cost):
    """The instant program's bound holds for plans that compress and charges the codec: here the
    cheapest plan compresses a (cost codec_cost) or recomputes it (cost 1)."""
    from fxopt.solvers.instant import instant_solve

    g = _chain(codec_cost)
    budget = simulate(g, Schedule(frozenset({1, 2}), (5, 6))).peak_bytes - 10
    best = solve(g, budget).timeline.recompute_cost
    bound = instant_solve(g, budget, time_limit=10).bound
    assert bound is not None and bound <= best + 1e-9
    assert bound == pytest.approx(min(codec_cost, 1.0), rel=1e-3)


def test_instant_program_counts_a_value_decoded_once_the_backward_has_read_it():
    """c (10 bytes, not recomputable, int8 keeps it in 1) is read by g_c; a (10 bytes, cost 2) by
    g_a after it. While g_c runs, c is decoded: x, tan, loss, g_loss, c and g_c are 24 bytes, and
    a SAVEd would make 34, over the budget of 30, so a is recomputed after g_c (cost 2). The
    instant program once let c count its compressed size there: it proved only the codec's
    0.05 and suggested saving a, a plan that peaks at 34; at 4 layers of GPT-2 small shapes its
    plans then never fitted, and the budget's plan was a heuristic's at twice its cost."""
    from fxopt.solvers.instant import instant_solve

    from solver_graphs import GraphBuilder

    b = GraphBuilder()
    b.input("x", 1)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 10, cost=2.0)
    b.fwd("c", ["a"], 10, recomputable=False)
    b.fwd("loss", ["c"], 1, output=True)
    b.bwd("g_loss", ["tan"], 1)
    b.bwd("g_c", ["g_loss", "c"], 10)
    b.bwd("g_a", ["g_c", "a"], 1, output=True)
    nodes = list(b.build().nodes)
    c = b.index["c"]
    nodes[c] = dataclasses.replace(nodes[c], codec="int8/g64", compressed_bytes=1, codec_cost=0.05)
    g = Graph(tuple(nodes))
    res = instant_solve(g, 30, time_limit=10)
    assert res.bound == pytest.approx(2.0)
    assert min(t.recompute_cost for _, t in res.plans if t.peak_bytes <= 30) == pytest.approx(2.0)
    best = solve(g, 30)
    assert (best.status, best.timeline.recompute_cost) == ("optimal", pytest.approx(2.0))


def test_the_planner_falls_back_on_planning_without_codecs(monkeypatch):
    """The solvers do not always find the lowest peak of the larger problem that codecs make; a
    budget that plans without them must plan with them. Here the instant program misses on the
    graph with a codec (it calls the budget infeasible) and compressing alone does not fit (a
    16-byte value that compresses to 15): the planner plans the graph without its codec instead
    (`fxopt.planner.solve_graph`, the planner's fallbacks on a solver graph alone)."""
    import dataclasses

    import fxopt.solvers.minimum as minimum
    import fxopt.solvers.phases as phases
    from fxopt.planner import Options, solve_graph
    from fxopt.solvers.instant import InstantResult, LowestPeak, instant_solve, lowest_peak, peak_lower_bound

    from solver_graphs import mlp2

    plain = mlp2()
    a = next(i for i, n in enumerate(plain.nodes) if n.name == "a")
    nodes = list(plain.nodes)
    nodes[a] = dataclasses.replace(nodes[a], codec="test", compressed_bytes=15, codec_cost=1e-3)
    graph = Graph(tuple(nodes))
    assert graph.compressible == frozenset({a})

    def misses_with_codecs(g, budget, **kwargs):
        if g.compressible:
            return InstantResult(bound=None, plans=(), instants=(), seconds=0.0, infeasible=True)
        return instant_solve(g, budget, **kwargs)

    def lowest_misses_with_codecs(g, **kwargs):  # (the same program without a budget)
        if g.compressible:
            return LowestPeak(peak_lower_bound(g)[0], (), (), 0.0)
        return lowest_peak(g, **kwargs)

    monkeypatch.setattr(phases, "instant_solve", misses_with_codecs)
    monkeypatch.setattr(minimum, "lowest_peak", lowest_misses_with_codecs)
    with pytest.raises(fxopt.InfeasibleBudgetError):
        solve(graph, 70, "instant")  # (the solvers alone: no fallback)
    messages = []
    import fxopt.planner as planner

    monkeypatch.setattr(planner, "progress_display", lambda: _Reporting(messages))
    solution = solve_graph(graph, 70, Options(budget=70, solver="instant"))
    assert "no plan fits with compression; planning without it" in messages
    assert not solution.schedule.compressed
    assert solution.timeline == simulate(graph, solution.schedule)
    assert solution.timeline.peak_bytes <= 70
    assert solution.timeline.recompute_cost == pytest.approx(3.0)  # mlp2's optimum at 70 bytes


class _Reporting:
    """A progress display that collects the messages."""

    def __init__(self, messages: list):
        self.messages = messages

    def __enter__(self):
        return self.messages.append

    def __exit__(self, *exc):
        return False


class PoolNet(nn.Module):
    """Three convolutions, each followed by a size-keeping max-pool: its int64 indices are the
    largest values the backward reads."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8))
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        for conv in self.convs:
            x = F.max_pool2d(conv(x), 3, stride=1, padding=1)
        return self.head(x.flatten(1)).sum()


def test_int32_codec_on_max_pool_indices_is_exact():
    """Max-pooling's int64 indices are offered the int32 codec (half the bytes); a plan that
    COMPRESSes them gives bit-identical gradients."""
    torch.manual_seed(0)
    model, inputs = PoolNet(), (torch.randn(16, 3, 16, 16),)
    saved = fxopt.plan(model, 1.0, inputs)
    graph = saved.graph
    int32 = {i for i, n in enumerate(graph.nodes) if n.codec == "int32"}
    assert len(int32) == 3 and int32 <= graph.compressible
    assert all(graph.nodes[i].compressed_bytes * 2 == graph.nodes[i].bytes for i in int32)
    # Replay the eager plan with the indices COMPRESSed.
    schedule = dataclasses.replace(saved.schedule, compressed=frozenset(int32))
    packed = fxopt.Plan.build(graph=graph, schedule=schedule, budget_bytes=saved.budget_bytes,
                              eager_peak_bytes=saved.eager_peak_bytes, solver="test", status="heuristic",
                              solve_seconds=0.0, fingerprint=saved.fingerprint)
    assert set(packed.compressed.values()) == {"int32"} and not packed.lossy
    assert packed.peak_bytes < saved.peak_bytes
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, saved.budget_bytes, plan_now=False, plan=packed)
    assert torch.equal(loss_e, loss_o)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        assert torch.equal(p_e.grad, p_o.grad)
    assert measured_peak(optimized, inputs) <= packed.peak_bytes
