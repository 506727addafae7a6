"""OFFLOAD in the rewritten step, on CPU (synchronous copies): loss and gradients bit-identical to
eager with every offloadable saved value offloaded, with and without compression; the copies sit
where the plan says; the host arena is reused from step to step."""

import copy
import dataclasses

import pytest
import torch

import fxopt
from fxopt.plan_ahead import plan_and_rewrite
from fxopt.models import ZOO
from fxopt.ops.offload import HostCopies, extent_bytes
from fxopt.passes.offload import reload_positions
from fxopt.solvers.schedule import kept_steps
from fxopt.solvers.plan import Plan
from fxopt.solvers.transfers import Transfers
from helpers import assert_same_step, run_pair, step

ops = torch.ops.fxopt
MODELS = ["residual_mlp", "cnn_bn", "gpt2_tiny", "transformer_block"]


def offload_everything(plan: Plan, compress: bool = False) -> Plan:
    """``plan`` with every offloadable SAVEd value OFFLOADed (and with ``compress``, every
    compressible one COMPRESSed too), reloaded where the simulator puts reloads by default."""
    saved = frozenset(plan.schedule.saved)
    compressed = saved & plan.graph.compressible if compress else plan.schedule.compressed
    schedule = dataclasses.replace(plan.schedule, offloaded=saved & plan.graph.offloadable,
                                   compressed=compressed, reload_at=())
    return Plan.build(graph=plan.graph, schedule=schedule, budget_bytes=plan.budget_bytes,
                      eager_peak_bytes=plan.eager_peak_bytes, solver="forced", status="heuristic",
                      solve_seconds=0.0, fingerprint=plan.fingerprint, module_paths=plan.module_paths)


def forced_pair(name: str, compress: bool, budget=1.0):
    """(eager, optimized, inputs, plan): the zoo model planned with offload on and then forced
    to offload every value it may."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    base = fxopt.plan(model, budget, inputs, offload=True, compress=compress)
    plan = offload_everything(base, compress)
    assert plan.offloaded, "nothing offloadable: the test would test nothing"
    optimized = fxopt.optimize(copy.deepcopy(model), budget, plan=plan, offload=True, compress=compress)
    return copy.deepcopy(model), optimized, inputs, plan


def _bit_identical(eager, optimized, inputs, seed=1):
    torch.manual_seed(seed)
    loss_e = step(eager, inputs)
    torch.manual_seed(seed)
    loss_o = step(optimized, inputs)
    assert torch.equal(loss_e, loss_o)
    for (name, p_e), (_, p_o) in zip(eager.named_parameters(), optimized.named_parameters()):
        assert (p_e.grad is None) == (p_o.grad is None), name
        if p_e.grad is not None:
            assert torch.equal(p_e.grad, p_o.grad), name
    assert_same_step(eager, optimized, loss_e, loss_o)  # buffers too (BatchNorm statistics)


@pytest.mark.parametrize("name", MODELS)
def test_offload_everything_is_bit_identical(name):
    eager, optimized, inputs, _ = forced_pair(name, compress=False)
    _bit_identical(eager, optimized, inputs)
    # A second step reuses the host arena (and the events' bookkeeping).
    for m in (eager, optimized):
        m.zero_grad(set_to_none=True)
    _bit_identical(eager, optimized, inputs, seed=2)


@pytest.mark.parametrize("name", ["residual_mlp", "cnn_bn", "gpt2_tiny"])
def test_offload_with_compression_is_bit_identical(name):
    eager, optimized, inputs, plan = forced_pair(name, compress=True)
    _bit_identical(eager, optimized, inputs)
    if name != "gpt2_tiny":  # (ReLU masks and pooling indices: COMPRESSed and OFFLOADed)
        both = [v for v in plan.offloaded if v in plan.compressed]
        assert both and plan.decisions()[both[0]] == "COMPRESS+OFFLOAD"


def test_the_graphs_copy_what_the_plan_offloads_where_it_says():
    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    plan = offload_everything(fxopt.plan(model, 1.0, inputs, offload=True, compress=False))
    ready = plan_and_rewrite(model, plan.budget_bytes, inputs, plan=plan, offload=True, compress=False)
    fw, bw = ready.forward.graph, ready.backward.graph
    offloads = list(fw.find_nodes(op="call_function", target=ops.offload.default))
    assert sorted(n.args[0].name for n in offloads) == sorted(plan.offloaded)
    saved = [o for o in next(iter(fw.find_nodes(op="output"))).args[0] if isinstance(o, torch.fx.Node)]
    assert set(offloads) <= set(saved)
    assert not {n.name for n in saved} & set(plan.offloaded)  # the device tensors are not saved
    order = list(fw.nodes)
    for n in offloads:  # right after the value's last forward use (other offloads aside)
        value, before = n.args[0], n.prev
        while before.target == ops.offload.default:
            before = before.prev
        assert before is value or before in value.users
        assert all(order.index(u) < order.index(n) for u in value.users if u is not n)
    # In the backward: each reload before the step the plan says, its wait right before the reader.
    order = list(bw.nodes)
    reloads = list(bw.find_nodes(op="call_function", target=ops.reload.default))
    waits = list(bw.find_nodes(op="call_function", target=ops.wait_reload.default))
    assert len(reloads) == len(waits) == len(plan.offloaded)
    for w in waits:
        assert order.index(w.args[0]) < order.index(w)
        first_reader = min(w.users, key=order.index)
        assert order.index(w) < order.index(first_reader)
    # Each reload is issued after as many of the backward's steps as the plan says.
    names = [n.name for n in plan.graph.nodes]
    at = reload_positions(len(plan.schedule.backward), kept_steps(plan.graph, plan.schedule),
                          plan.schedule.reload_at, names)
    planned = {value: position for position, values in at.items() for value in values}
    steps, issued = 0, {}
    for n in order:
        if n.op == "call_function" and n.target == ops.reload.default:
            issued[n.args[0].name] = steps  # (the host copy's placeholder is named after the value)
        elif n.op == "call_function" and n.target != ops.wait_reload.default:
            steps += 1
    assert issued == planned and len(set(planned.values())) > 1


def test_reload_positions_move_to_the_next_kept_step():
    names = ["a", "b", "c"]
    # Steps 1 and 3 of 5 are dropped (recomputations nothing reads): kept = [0, 2, 4].
    at = reload_positions(5, [0, 2, 4], [(0, 1), (1, 2), (2, 4)], names)
    assert at == {1: ["a", "b"], 2: ["c"]}


def test_host_arena_is_allocated_once_and_a_step_in_flight_takes_another():
    copies = HostCopies([extent_bytes((4, 3), (3, 1), 4), extent_bytes((5,), (1,), 8)])
    x, y = torch.randn(4, 3), torch.arange(5, dtype=torch.float64)
    for _ in range(3):  # step after step: the same arena
        hx, hy = copies.offload(x, 0), copies.offload(y, 1)
        assert torch.equal(copies.reload(hx, 0, x.device), x) and torch.equal(copies.reload(hy, 1, y.device), y)
        del hx, hy
    assert len(copies.arenas) == 1
    first = copies.offload(x, 0)  # a forward whose backward has not run yet
    second = copies.offload(x * 2, 0)  # ... and another: its slot is busy, so a second arena
    assert len(copies.arenas) == 2
    assert torch.equal(copies.reload(first, 0, x.device), x) and torch.equal(copies.reload(second, 0, x.device), x * 2)
    dropped = copies.offload(x, 0)  # a host copy dropped unread (its backward never ran) frees its slot
    del dropped
    copies.offload(x, 0)
    assert len(copies.arenas) == 2


def test_non_contiguous_values_keep_their_strides():
    copies = HostCopies([extent_bytes((3, 4), (1, 3), 4)])
    x = torch.randn(4, 3).t()
    host = copies.offload(x, 0)
    back = copies.reload(host, 0, x.device)
    assert back.stride() == x.stride() and torch.equal(back, x)


def test_offload_option_on_cpu():
    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    off = fxopt.plan(model, 1.0, inputs)  # default on CPU: off
    assert off.graph.transfers is None
    on = fxopt.plan(model, 1.0, inputs, offload=True)
    assert on.graph.transfers == Transfers()  # CPU: the documented defaults
    assert on.fingerprint != off.fingerprint
    with pytest.raises(fxopt.BudgetError, match="offload='yes': pass True, False, None or a host memory limit"):
        fxopt.plan(model, 1.0, inputs, offload="yes")
    with pytest.raises(TypeError):
        fxopt.plan(model, 1.0, inputs, offload=[True])


@pytest.mark.slow
def test_offload_under_inductor_changes_no_bit():
    """Inductor's numerics differ from eager's (fused reductions), so the reference is the same
    plan without OFFLOAD, compiled by Inductor too."""
    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    base = fxopt.plan(model, 1.0, inputs, offload=True, compress=True, compiler="inductor")
    results = []
    for plan in (base, offload_everything(base, compress=True)):
        optimized = fxopt.optimize(copy.deepcopy(model), 1.0, plan=plan, offload=True, compiler="inductor")
        torch.manual_seed(1)
        results.append((step(optimized, inputs), [p.grad for p in optimized.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.slow
def test_the_planner_offloads_where_recomputation_alone_cannot_fit():
    """residual_mlp at half its eager peak: infeasible with SAVE / RECOMPUTE / COMPRESS alone, and
    planned with OFFLOAD when asked (on CPU with the default bandwidths); the step runs exactly."""
    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    with pytest.raises(fxopt.InfeasibleBudgetError):
        fxopt.plan(model, 0.5, inputs)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, 0.5, offload=True)
    plan = optimized.plan
    assert plan.offloaded and plan.peak_bytes <= plan.budget_bytes and plan.host_bytes > 0
    assert "OFFLOAD" in plan.decisions().values()
    assert torch.equal(loss_e, loss_o)
    assert_same_step(eager, optimized, loss_e, loss_o)


def test_fingerprint_counts_transfers_only_when_set():
    from fxopt.analysis import graph_fingerprint

    torch.manual_seed(0)
    model, inputs = ZOO["residual_mlp"]()
    plan = fxopt.plan(model, 1.0, inputs, offload=False)
    graph = plan.graph
    assert graph_fingerprint(graph) == plan.fingerprint == graph_fingerprint(graph.with_transfers(None))
    fast = graph_fingerprint(graph.with_transfers(Transfers(50e9, 50e9)))
    assert fast != plan.fingerprint and fast != graph_fingerprint(graph.with_transfers(Transfers()))


def test_bandwidths_are_measured_once_per_device_and_cached_on_disk(tmp_path, monkeypatch):
    from fxopt.analysis import bandwidth

    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "_measured", {})
    runs = []

    def measure(device):
        runs.append(device)
        return Transfers(12e9, 34e9)

    monkeypatch.setattr(bandwidth, "measure", measure)
    cuda = torch.device("cuda", 0)
    assert bandwidth.device_transfers(cuda) == Transfers(12e9, 34e9)
    assert bandwidth.device_transfers(cuda) == Transfers(12e9, 34e9)
    assert len(runs) == 1 and (tmp_path / "bandwidth.json").exists()
    monkeypatch.setattr(bandwidth, "_measured", {})  # a new process: read from disk
    assert bandwidth.device_transfers(cuda) == Transfers(12e9, 34e9) and len(runs) == 1
    assert bandwidth.device_transfers(torch.device("cpu")) == Transfers()  # nothing to measure


def test_the_backend_takes_offload():
    from fxopt.capture.backend import backend

    assert backend(0.5, offload=False).options.offload is False


def test_two_forwards_before_one_backward():
    """Gradient accumulation in one graph: the second forward finds the first one's host slots
    still held, takes a second arena, and both backwards read their own values."""
    eager, optimized, inputs, _ = forced_pair("residual_mlp", compress=False)
    (x,) = inputs
    other = (x.flip(0),)
    losses = []
    for m in (eager, optimized):
        torch.manual_seed(1)
        loss = m(*inputs).sum() + 2 * m(*other).sum()
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        assert torch.equal(p_e.grad, p_o.grad)
    from fxopt.ops.offload import _runtimes

    assert any(len(copies.arenas) == 2 for copies in _runtimes.values())


def test_a_host_memory_limit_bounds_what_is_offloaded():
    """``offload="<size>"``: offload on, the plan's host memory within that size; a fraction is
    refused with a message; the limit is part of the plan's graph (and so of its cache key)."""
    model, inputs = ZOO["residual_mlp"]()[:2]
    free = fxopt.plan(copy.deepcopy(model), 0.6, inputs, offload=True, time_limit=5)
    assert free.offloaded and free.host_bytes > 0
    limit = free.host_bytes // 2
    held = fxopt.plan(copy.deepcopy(model), 0.6, inputs, offload=limit, time_limit=5)
    assert held.graph.transfers.host_budget == limit
    assert held.host_bytes <= limit and held.peak_bytes <= held.budget_bytes
    with pytest.raises(fxopt.BudgetError, match="not a fraction"):
        fxopt.plan(copy.deepcopy(model), 0.6, inputs, offload="50%")
