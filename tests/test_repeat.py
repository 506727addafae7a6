"""A run of identical blocks captured as three and four blocks and stamped out
(`fxopt.capture.repeat`): the stamped joint graph is the whole capture's, node for node, and so
is every plan made from it; where the blocks are not one block N times, the step is captured
whole."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import fxopt
import fxopt.capture.repeat as repeat
from fxopt.capture.repeat import NotStamped, check_same, repeated_run
from fxopt.fitting import at_batch
from fxopt.models import gpt2
from fxopt.options import Options
from fxopt.capture.shapes import DynamicDims
from fxopt.plan_ahead import _capture, _stamped, _symbolic_stamped, capture_symbolic, plan_and_rewrite, split_inputs


def tiny_llama(layers: int = 6, batch: int = 1):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (batch, 16))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def tiny_gpt(layers: int = 6):
    torch.manual_seed(0)
    return gpt2(layers=layers, dim=32, heads=2, seq=16, batch=2, vocab=64)


# The solvers' effort where a test compares two plans (`fxopt.Options.effort`, a multiple of the
# default): the same inputs and effort give the same plan, so a quarter of the default still
# tells two graphs apart, and the plans at "min" were most of these tests' time.
EFFORT = 0.25


def decisions(plan: fxopt.Plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k != "solve_seconds"}


@pytest.mark.slow
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt], ids=["llama", "gpt2"])
def test_a_stamped_step_is_the_whole_capture_node_for_node(build, monkeypatch):
    """Six blocks stamped from three and four: every node's name, op, arguments, tags, seq_nr,
    module path and fake value (shape, strides, which share storage) is the six-block
    capture's, the memory the step does not read too, and the plans made from the two are one
    plan."""
    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    model, inputs = build()
    run = repeated_run(model)
    assert run is not None and len(run.keys) == 6
    args, kwargs = split_inputs(inputs)
    options = Options.of("min", effort=EFFORT)
    whole = _capture(model, options, args, kwargs, lambda step: step)
    stamped = _stamped(model, run, options, args, kwargs, lambda step: step)
    check_same(stamped.joint.graph, whole.joint.graph)
    assert stamped.unread_bytes == whole.unread_bytes
    assert len(list(model.parameters())) == len(list(run.holder.parameters())) + sum(
        1 for name, _ in model.named_parameters() if not name.startswith(_prefix(model, run.holder)))
    assert decisions(stamped.plan(options).plan) == decisions(whole.plan(options).plan)


def _prefix(model: nn.Module, holder: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is holder)


@pytest.mark.slow
def test_fxopt_plan_stamps_and_gives_the_plan_of_the_whole_capture(monkeypatch):
    """`fxopt.plan` stamps a run (counted: `stamped_joint` called once) and plans what the whole
    capture plans, at the smallest budget; ``stamp=False`` captures every block."""
    import fxopt.plan_ahead

    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    calls = []
    real = fxopt.plan_ahead.stamped_joint
    monkeypatch.setattr(fxopt.plan_ahead, "stamped_joint", lambda *a: calls.append(1) or real(*a))
    model, inputs = tiny_gpt()
    stamped = fxopt.plan(model, "min", inputs, effort=EFFORT)
    assert calls == [1]
    torch._dynamo.reset()
    whole = fxopt.plan(model, "min", inputs, stamp=False, effort=EFFORT)
    assert calls == [1] and decisions(stamped) == decisions(whole)


class Alternating(nn.Module):
    """Every other block adds a tanh: the same class, parameters and attributes, another graph."""

    def __init__(self, index: int, width: int = 16):
        super().__init__()
        self.layer_idx, self.fc = index, nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return x + (torch.tanh(h) if self.layer_idx % 2 else h)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int = 16):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(blocks), nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


@pytest.mark.slow
def test_blocks_whose_graph_changes_with_their_index_are_captured_whole(monkeypatch, caplog):
    """A run whose every other block differs passes the attribute check (the index is an int
    that counts the blocks) and fails the stamping check on four blocks: planned from the whole
    capture, the same plan as without stamping."""
    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    torch.manual_seed(0)
    model, x = Stack([Alternating(i) for i in range(6)]), torch.randn(8, 16, requires_grad=True)
    run = repeated_run(model)
    assert run is not None
    args, kwargs = split_inputs((x,))
    with pytest.raises(NotStamped):
        _stamped(model, run, Options.of("min"), args, kwargs, lambda step: step)
    with caplog.at_level(logging.INFO, logger="fxopt"):
        planned = plan_and_rewrite(model, "min", (x,), plan_only=True).plan
    assert "capturing all 6 blocks" in caplog.text
    torch._dynamo.reset()
    assert decisions(planned) == decisions(fxopt.plan(model, "min", (x,), stamp=False))


def test_a_run_is_only_identical_blocks_sharing_nothing():
    """Blocks of other shapes, other attributes, with hooks or with tied weights are not a run."""
    def blocks(n=8, width=16):
        torch.manual_seed(0)
        return [Alternating(i, width) for i in range(n)]

    assert repeated_run(Stack(blocks())) is not None
    assert repeated_run(Stack(blocks(7))) is None  # (fewer than STAMP_FROM)
    odd = blocks()
    odd[3].fc = nn.Linear(16, 16, bias=False)
    assert repeated_run(Stack(odd)) is None
    odd = blocks()
    odd[5].scale = 2.0
    assert repeated_run(Stack(odd)) is None
    hooked = blocks()
    hooked[2].register_forward_hook(lambda *a: None)
    assert repeated_run(Stack(hooked)) is None
    tied = blocks()
    tied[4].fc.weight = tied[0].fc.weight
    assert repeated_run(Stack(tied)) is None


def symbolic(model: nn.Module, inputs, stamp: bool, *, point: int = 2):
    """`capture_symbolic` (as `fxopt.max_batch` captures: the batch symbolic, 1 to 64) at batch
    ``point``: (the step as captured, as rewritten), and the batch's symbol's name."""
    dims = DynamicDims.parse({"batch": (1, 64)})
    name = dims.ranges.names[0]
    torch._dynamo.reset()
    return capture_symbolic(model, inputs, dims, {name: point}, Options(budget=1, stamp=stamp)), name


@pytest.mark.slow
@pytest.mark.parametrize("build", [lambda: tiny_llama(batch=2), tiny_gpt], ids=["llama", "gpt2"])
def test_a_stamped_symbolic_capture_is_the_whole_one_node_for_node(build, monkeypatch):
    """The symbolic capture (`capture_symbolic`, `fxopt.max_batch`'s: sizes as expressions in the
    batch) stamps six blocks from three and four: the step as captured and as rewritten are the
    whole capture's node for node (sizes as text in the batch's symbol), the range it holds for
    is the same (the Llama's batch of 1 set apart in both), and its solver graph is the same at
    every batch asked."""
    import fxopt.plan_ahead

    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    calls = []
    real = fxopt.plan_ahead.stamped_joint
    monkeypatch.setattr(fxopt.plan_ahead, "stamped_joint", lambda *a: calls.append(1) or real(*a))
    model, inputs = build()[:2]
    (eager, jg), name = symbolic(model, inputs, True)
    assert calls == [1]
    (whole_eager, whole_jg), _ = symbolic(model, inputs, False)
    assert calls == [1]
    check_same(eager.module.graph, whole_eager.module.graph)
    check_same(jg.module.graph, whole_jg.module.graph)
    assert (jg.names, jg.module_paths, jg.num_fwd_outputs) == (whole_jg.names, whole_jg.module_paths,
                                                                whole_jg.num_fwd_outputs)
    assert jg.symbolic.ranges == whole_jg.symbolic.ranges
    lo, hi = jg.symbolic.ranges.bounds[name]
    assert jg.graph.nodes == whole_jg.graph.nodes and eager.graph.nodes == whole_eager.graph.nodes
    for batch in sorted({lo, 3, 17, hi}):
        assert jg.symbolic.at({name: batch}).nodes == whole_jg.symbolic.at({name: batch}).nodes
        assert eager.symbolic.at({name: batch}).nodes == whole_eager.symbolic.at({name: batch}).nodes


def test_a_symbolic_capture_narrowed_keeps_its_three_blocks(monkeypatch):
    """The Llama sets a batch of 1 apart: its three-block capture for batches 1 to 64 holds for 2
    to 64 only. That capture is kept for the range narrowed (its guards hold there), and only the
    four-block one is made for it: two captures, not three (each of a real-size model's takes
    seconds), with the range and graphs of the whole capture (the test above)."""
    import fxopt.plan_ahead

    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    captures = []
    real = fxopt.plan_ahead._capture_symbolic
    monkeypatch.setattr(fxopt.plan_ahead, "_capture_symbolic", lambda *a, **k: captures.append(1) or real(*a, **k))
    model, inputs = tiny_llama(batch=2)
    (eager, jg), name = symbolic(model, inputs, True)
    assert jg.symbolic.ranges.bounds[name] == (2, 64)
    assert len(captures) == 2


@pytest.mark.slow
def test_a_symbolic_capture_of_blocks_whose_graph_changes_with_their_index_is_captured_whole(monkeypatch, caplog):
    """The run whose every other block differs, captured symbolically: the stamping check fails,
    and `capture_symbolic` captures every block (the whole capture's graphs)."""
    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    torch.manual_seed(0)
    model, x = Stack([Alternating(i) for i in range(6)]), torch.randn(8, 16, requires_grad=True)
    run = repeated_run(model)
    dims = DynamicDims.parse({"batch": (1, 64)})
    point = {dims.ranges.names[0]: 8}
    with pytest.raises(NotStamped):
        _symbolic_stamped(model, run, (x,), {}, dims, point, Options(budget=1, offload=False))
    with caplog.at_level(logging.INFO, logger="fxopt"):
        (eager, jg), _ = symbolic(model, (x,), True, point=8)
    assert "capturing all 6 blocks" in caplog.text
    (whole_eager, whole_jg), _ = symbolic(model, (x,), False, point=8)
    check_same(jg.module.graph, whole_jg.module.graph)
    assert jg.graph.nodes == whole_jg.graph.nodes


@pytest.mark.slow
def test_max_batch_leaves_what_it_captured_out_of_full_collections(monkeypatch):
    """`fxopt.max_batch` freezes the heap (`fxopt.planner.heap_frozen`), then again after each
    piece of work that makes what the next keeps: the two captures before stamping, the stamped
    step before its analysis, the analysed step before the search. Counted in objects left out
    of Python's full collections (`gc.get_freeze_count`), which each full collection the search
    triggers would walk again: more at each of those points, none once it has answered. (Freezing
    changes no answer: it only chooses what a full collection walks.)"""
    import gc

    import fxopt.maxbatch
    import fxopt.plan_ahead

    if gc.get_freeze_count() or not gc.isenabled():
        pytest.skip("this process froze objects of its own (or collects none): max_batch leaves those alone")
    monkeypatch.setattr(repeat, "STAMP_FROM", 6)
    frozen: dict[str, int] = {}

    def counted(module, name):
        real = getattr(module, name)

        def call(*a, **k):
            frozen.setdefault(name, gc.get_freeze_count())
            return real(*a, **k)

        monkeypatch.setattr(module, name, call)

    for module, name in ((fxopt.plan_ahead, "_capture_symbolic"), (fxopt.plan_ahead, "stamped_joint"),
                         (fxopt.plan_ahead, "analyze_for_planning"), (fxopt.maxbatch, "_search")):
        counted(module, name)
    model, inputs = tiny_llama(batch=2)
    torch._dynamo.reset()
    found = fxopt.max_batch(model, "1GiB", lambda b: at_batch(inputs, b), limit=4, effort=EFFORT)
    assert gc.get_freeze_count() == 0 and found.batch == 4
    order = [frozen[name] for name in ("_capture_symbolic", "stamped_joint", "analyze_for_planning", "_search")]
    assert 0 < order[0] < order[1] < order[2] < order[3], order
