"""The analysis never guesses in the unsafe direction: an op whose scratch memory cannot be
measured is assumed to hold a conservative amount, never zero; an op whose FLOPs cannot be counted
is never offered for recomputation."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from fxopt.analysis import costs, scratch
from fxopt.analysis.joint import _is_recomputable


@torch.library.custom_op("fxopt_test::fails_on_real_inputs", mutates_args=())
def fails_on_real_inputs(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this op cannot run on made-up inputs")


@fails_on_real_inputs.register_fake
def _(x):
    return torch.empty_like(x)


def one_op_graph(target, *shapes) -> fx.Node:
    graph = fx.Graph()
    with FakeTensorMode() as mode:
        args = []
        for k, shape in enumerate(shapes):
            p = graph.placeholder(f"x{k}")
            p.meta["val"] = torch.empty(shape)
            args.append(p)
        node = graph.call_function(target, tuple(args))
        node.meta["val"] = target(*(a.meta["val"] for a in args))
    del mode
    graph.output(node)
    return node


def test_an_op_that_cannot_be_measured_is_assumed_to_hold_more_than_its_tensors(caplog):
    node = one_op_graph(torch.ops.fxopt_test.fails_on_real_inputs.default, (256, 64))
    scratch._cache.clear()
    increases = scratch.op_increases([node])
    tensor_bytes = 2 * 256 * 64 * 4  # its input and its output
    assert increases[node] == scratch.UNMEASURED_FACTOR * tensor_bytes > 0
    assert "could not measure the scratch memory" in caplog.text


def test_an_op_that_can_be_measured_is_measured():
    node = one_op_graph(torch.ops.aten.mm.default, (64, 32), (32, 16))
    scratch._cache.clear()
    assert 64 * 16 * 4 <= scratch.op_increases([node])[node] < scratch.UNMEASURED_FACTOR * (64 * 32 + 32 * 16 + 64 * 16) * 4


def test_an_op_whose_flops_cannot_be_counted_is_not_recomputed(monkeypatch):
    node = one_op_graph(torch.ops.aten.mm.default, (64, 32), (32, 16))
    assert costs.flops_of(node) == 2 * 64 * 32 * 16 and _is_recomputable(node)

    def broken(*args, **kwargs):
        raise TypeError("this formula does not fit")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, broken)
    assert costs.flops_of(node) is None
    assert not _is_recomputable(node)


def test_ops_torch_counts_as_free_stay_recomputable():
    node = one_op_graph(torch.ops.aten.relu.default, (64, 32))
    assert costs.flops_of(node) == 0 and _is_recomputable(node)


def test_cost_model_adds_compute_traffic_and_overhead():
    model = costs.CostModel(flops_per_second=1e9, bytes_per_second=1e8, op_overhead=1e-3)
    assert model.seconds(2_000_000_000, 300_000_000, False) == 2.0 + 3.0 + 1e-3
    assert model.seconds(2_000_000_000, 300_000_000, True) == 1e-4  # a view moves nothing


def test_scratch_measurements_are_cached_on_disk_per_machine(tmp_path, monkeypatch):
    """A second process (here: a cleared in-process cache) reads measurements from disk instead of
    running the ops again; an unmeasurable op's estimate is not written; FXOPT_CACHE=0 keeps
    nothing; a damaged file is ignored and replaced."""
    monkeypatch.setenv("FXOPT_CACHE", "1")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    mm = one_op_graph(torch.ops.aten.mm.default, (64, 32), (32, 16))
    bad = one_op_graph(torch.ops.fxopt_test.fails_on_real_inputs.default, (256, 64))
    runs = []
    real_measure = scratch._measure
    monkeypatch.setattr(scratch, "_measure", lambda todo, at: runs.append(len(todo)) or real_measure(todo, at))

    def fresh_process():
        scratch._cache.clear()
        scratch._on_disk.clear()

    fresh_process()
    first = scratch.op_increases([mm, bad])
    files = list((tmp_path / "scratch").glob("*.json"))
    assert len(files) == 1 and runs == [2]
    fresh_process()
    assert scratch.op_increases([mm, bad]) == first
    assert runs == [2, 1]  # the unmeasurable op is tried again, mm is read from disk

    files[0].write_text("{not json")
    fresh_process()
    assert scratch.op_increases([mm]) == {mm: first[mm]} and runs[-1] == 1

    monkeypatch.setenv("FXOPT_CACHE", "0")
    fresh_process()
    scratch.op_increases([mm])
    assert runs[-1] == 1
