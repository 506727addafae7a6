"""Real models, unmodified (issue 11): Hugging Face ``transformers`` models from
`benchmarks.hf_zoo` (small configs, random weights, nothing downloaded), each returning the loss
HF computes itself, trained one step through fxopt.

For every model, at two budgets:

- half its activations: ``resident + (eager_peak - resident) / 2``, where ``resident`` is what
  the step cannot free (parameters, buffers, inputs) and ``eager_peak`` the plan's predicted peak
  of the un-rewritten step. Where no plan fits, the error must name a larger minimum, and the
  step runs at that minimum instead;
- its minimum: the ``min_budget`` fxopt names when asked for a budget nothing fits;

the step's measured peak is within the budget and within the prediction, and its loss and every
gradient equal eager's. Then, on a few models each: dropout 0.1 (eager's masks kept, so gradients
still equal), the ``torch.compile(backend="fxopt")`` form, HF's own gradient checkpointing
switched on, `FlopCounterMode` counting exactly the plan's extra FLOPs, and bfloat16 autocast.

Capturing and planning dominate the run time, so each model's minimum and each (model, budget)
step run once per module and are shared (`_minimum`, `_step`); ``TIME_LIMIT`` is the solvers' safety stop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # real models, each captured and planned at two budgets

from fxopt.solvers import DEFAULT_TIME_LIMIT
import fxopt  # noqa: E402
import benchmarks.hf_zoo  # noqa: E402,F401  (registers the HF models in fxopt.models.MODELS)
from fxopt.models import MODELS as ZOO_MODELS  # noqa: E402
from helpers import assert_same_step, measured_peak, run_pair, step  # noqa: E402

TIME_LIMIT = DEFAULT_TIME_LIMIT  # a safety stop: the solvers' effort is counted, not timed
TINY = 1  # byte: nothing fits, so planning names the minimum
MODELS = ("gpt2", "bert", "llama", "t5", "vit", "resnet", "convnext")


@pytest.fixture(autouse=True, scope="module")
def _release_shared_steps():
    """The shared models, plans and compiled steps live as long as this module's tests."""
    yield
    for cached in (_model, _minimum, _step, _at_full):
        cached.cache_clear()


@functools.cache
def _model(name: str, dropout: float = 0.0):
    """The model (same weights every time: seeded) and its inputs; callers copy the model."""
    torch.manual_seed(0)
    return ZOO_MODELS[f"hf-{name}"]("test", dropout=dropout)


def resident_bytes(model, inputs) -> int:
    """What no plan can free: parameters, buffers and inputs."""
    tensors = [*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def _minimum(name: str, dropout: float = 0.0) -> int:
    model, inputs = _model(name, dropout)
    with pytest.raises(fxopt.InfeasibleBudgetError) as err:
        fxopt.plan(copy.deepcopy(model), TINY, inputs, time_limit=TIME_LIMIT)
    return err.value.min_budget


@dataclasses.dataclass
class Step:
    """One training step of a model through fxopt at a budget, next to eager's."""

    budget: int
    plan: fxopt.Plan
    measured: int
    parity_error: str | None  # assert_same_step's message, None when loss and gradients equal
    module: fxopt.FxoptModule
    loss: torch.Tensor  # the step's loss and gradients (before the measuring step replaced them)
    grads: list[torch.Tensor]

    def check(self):
        assert self.plan.peak_bytes <= self.budget
        assert self.measured <= self.budget, f"measured {self.measured} B > budget {self.budget} B"
        assert self.measured <= self.plan.peak_bytes, \
            f"measured {self.measured} B > predicted {self.plan.peak_bytes} B"
        assert self.parity_error is None, self.parity_error


@functools.cache
def _step(name: str, budget: int, dropout: float = 0.0) -> Step:
    """One step eagerly and through fxopt at ``budget`` (planned at the first call, so the step
    is captured once), under the same seed (run_pair's)."""
    model, inputs = _model(name, dropout)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, plan_now=False, time_limit=TIME_LIMIT)
    try:
        assert_same_step(eager, optimized, loss_e, loss_o)
        parity_error = None
    except AssertionError as e:
        parity_error = str(e)
    grads = [p.grad.clone() for p in optimized.parameters() if p.grad is not None]
    return Step(budget, optimized.plan, measured_peak(optimized, inputs), parity_error, optimized,
                loss_o.detach(), grads)


def _half_activations(name: str) -> int:
    model, inputs = _model(name)
    eager_peak = _step(name, _minimum(name)).plan.eager_peak_bytes
    resident = resident_bytes(model, inputs)
    return resident + (eager_peak - resident) // 2


@pytest.mark.parametrize("name", MODELS)
def test_at_its_minimum(name):
    run = _step(name, _minimum(name))
    run.check()


@pytest.mark.parametrize("name", MODELS)
def test_at_half_its_activations(name):
    """Half its activations is planned when it is at least the minimum fxopt names, and refused,
    naming a larger minimum, when it is below; then the step runs at that budget or that minimum."""
    budget, minimum = _half_activations(name), _minimum(name)
    if budget < minimum:
        with pytest.raises(fxopt.InfeasibleBudgetError) as err:
            _step(name, budget)
        assert err.value.min_budget > budget
        budget = err.value.min_budget
    _step(name, budget).check()


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dropout_masks_are_eagers(name):
    """Dropout 0.1 at the minimum, under the same seed: fxopt runs each dropout once, where eager
    does, and recomputes from its mask, so gradients still equal eager's."""
    run = _step(name, _minimum(name, 0.1), 0.1)
    run.check()
    assert run.plan.recomputed, "nothing recomputed: the minimum should force recomputation"


def _trained(model, inputs, budget, **options):
    """One step of a copy of ``model`` through fxopt at ``budget`` (eager where None) under seed 1:
    (its loss, its gradients, its plan, its measured peak)."""
    copied = copy.deepcopy(model)
    module = copied if budget is None else fxopt.optimize(copied, budget, example_inputs=inputs,
                                                           time_limit=TIME_LIMIT, **options)
    torch.manual_seed(1)
    loss = step(module, inputs).detach()
    grads = [p.grad.clone() for p in copied.parameters() if p.grad is not None]
    plan = getattr(module, "plan", None)
    return loss, grads, plan, None if budget is None else measured_peak(module, inputs)


@pytest.mark.parametrize("name, dropout", [("gpt2", 0.1), ("llama", 0.0)])
def test_loss_backward_in_place_is_bit_equal(name, dropout):
    """The cross-entropy's backward written over its incoming gradient (`fxopt.passes.loss`, the
    ``loss_in_place`` default), at full budget and at the minimum: the loss and every gradient
    bit-equal to eager's and to the step planned without it (dropout's under the same seed), the
    measured peak the predicted one (within 128 B: Llama's minimum measures 64 B under it, with or
    without), and at full budget (the loss's backward the peak) lower. (At the minimum the step
    with it is the shared one, `_step`: the same default options, planned at the first call.)"""
    model, inputs = _model(name, dropout)
    eager_loss, eager_grads, _, _ = _trained(model, inputs, None)
    minimum = _minimum(name, dropout)
    for budget in (1.0, minimum):
        if budget == minimum:
            run = _step(name, minimum, dropout)
            on_loss, on_grads, on, on_peak = run.loss, run.grads, run.plan, run.measured
        else:
            on_loss, on_grads, on, on_peak = _trained(model, inputs, budget)
        off_loss, off_grads, off, off_peak = _trained(model, inputs, budget, loss_in_place=False)
        assert any(n.name.startswith("_log_softmax_backward_data_out") for n in on.graph.nodes)
        assert torch.equal(on_loss, eager_loss) and torch.equal(off_loss, eager_loss)
        assert len(on_grads) == len(off_grads) == len(eager_grads)
        for g_on, g_off, g_eager in zip(on_grads, off_grads, eager_grads):
            assert torch.equal(g_on, g_eager) and torch.equal(g_off, g_eager)
        assert on_peak <= on.peak_bytes and off_peak <= off.peak_bytes
        assert on.peak_bytes - on_peak <= 128 and off.peak_bytes - off_peak <= 128, (on_peak, on.peak_bytes)
        if budget == 1.0:
            assert on_peak < off_peak, (on_peak, off_peak)


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_torch_compile_backend(name):
    model, inputs = _model(name)
    budget = _minimum(name)
    eager = copy.deepcopy(model)
    compiled = torch.compile(copy.deepcopy(model), backend="fxopt",
                             options={"budget": budget, "compiler": "eager", "time_limit": TIME_LIMIT})
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    torch.manual_seed(1)
    loss_o = step(compiled, inputs)
    assert_same_step(eager, compiled, loss_e, loss_o)
    assert measured_peak(compiled, inputs) <= budget


@pytest.mark.parametrize("name", ["bert"])
def test_hf_gradient_checkpointing_on(name):
    """HF's own checkpointing switched on: fxopt captures the step with it and plans the whole
    step itself; gradients equal eager's with HF checkpointing."""
    model, inputs = _model(name)
    model = copy.deepcopy(model)
    # the new name of gradient_checkpointing_enable() (deprecated in transformers 5)
    enable = getattr(model.hf, "activation_checkpointing_enable", None) or model.hf.gradient_checkpointing_enable
    enable()
    assert getattr(model.hf, "is_activation_checkpointing", None) or model.hf.is_gradient_checkpointing
    budget = _minimum(name)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, plan_now=False, time_limit=TIME_LIMIT)
    assert_same_step(eager, optimized, loss_e, loss_o)
    # fxopt sees the whole step, as without HF's checkpointing, and plans it itself
    assert optimized.plan.eager_peak_bytes == _step(name, budget).plan.eager_peak_bytes
    assert optimized.plan.peak_bytes <= budget
    assert measured_peak(optimized, inputs) <= budget


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_flop_counter_counts_the_recomputation(name):
    """FlopCounterMode around an fxopt step counts eager's FLOPs plus the plan's recompute_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    model, inputs = _model(name)
    plan = _step(name, _minimum(name)).plan
    assert plan.recompute_flops > 0
    # The plan replayed: planning anew (Dynamo's caches are reset between tests) under a time
    # limit may choose another plan.
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan)
    step(optimized, inputs)  # captured outside the mode
    optimized.zero_grad()  # (a step with gradients already there is planned on its own)
    with FlopCounterMode(display=False) as counted_eager:
        step(copy.deepcopy(model), inputs)
    with FlopCounterMode(display=False) as counted:
        step(optimized, inputs)
    assert all(p is plan for p in optimized.plans)
    assert counted.get_total_flops() == counted_eager.get_total_flops() + plan.recompute_flops


@pytest.mark.parametrize("name", ["llama"])
def test_bfloat16_autocast(name):
    """Under bfloat16 autocast the step is captured and planned as it runs (bfloat16 activations),
    within the budget, and its loss is eager-under-autocast's."""
    model, inputs = _model(name)
    # the bfloat16 step's own minimum: it is not float32's (autocast's bfloat16 copies of the
    # weights are activations of the step, so it can need more)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(fxopt.InfeasibleBudgetError) as err:
        fxopt.plan(copy.deepcopy(model), TINY, inputs, time_limit=TIME_LIMIT)
    budget = err.value.min_budget
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, time_limit=TIME_LIMIT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_e = eager(*inputs)
        loss_o = optimized(*inputs)
    loss_e.backward()
    loss_o.backward()
    torch.testing.assert_close(loss_o, loss_e, rtol=1.6e-2, atol=1e-3)  # bfloat16's resolution
    assert optimized.plan.peak_bytes <= budget
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad, rtol=1.6e-2, atol=1e-3)


def test_hf_trainer_trains_an_fxopt_model(tmp_path):
    """HF's ``Trainer`` with gradient accumulation, given ``fxopt.optimize(model, ...)``: it reads
    ``forward``'s signature to keep the dataset's columns (the original's: ``input_ids``,
    ``labels``, ...), passes ``num_items_in_batch``, and accumulates gradients over two
    micro-batches (the second step is planned counting the held gradients). Its losses and the
    trained weights are eager Trainer's."""
    pytest.importorskip("accelerate")
    import inspect

    import transformers

    hf = _model("gpt2")[0].hf
    wrapped, inputs = ZOO_MODELS["hf-gpt2"]("test")
    named = dict(zip(wrapped.names, inputs))
    rows = [{k: v[i % len(v)] for k, v in named.items()} for i in range(8)]
    runs = {}
    for name, model in (("eager", copy.deepcopy(hf)), ("fxopt", fxopt.optimize(copy.deepcopy(hf), 0.9, time_limit=TIME_LIMIT))):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, max_steps=2, report_to=[], use_cpu=True,
                                              save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        runs[name] = model, trainer.train().training_loss, [log["loss"] for log in trainer.state.log_history if "loss" in log]
    (eager, loss_e, logs_e), (optimized, loss_o, logs_o) = runs["eager"], runs["fxopt"]
    assert inspect.signature(optimized.forward) == inspect.signature(hf.forward)
    assert len(optimized.plans) == 2 and all(p.peak_bytes <= p.budget_bytes for p in optimized.plans)
    assert logs_o == pytest.approx(logs_e) and loss_o == pytest.approx(loss_e)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o, p_e)


# Issue 24, items 11 and 3: transformers architectures (`benchmarks.hf_breadth`'s small configs)
# whose predicted eager peak was 6-10% above the measured one, and whose fxopt step at 100%
# measured above eager's: RMSNorm's backward-only ``pow(x, 1)`` made in the forward and kept,
# what a backward formula reads freed mid-formula, dropout(p=0)'s copy (mt5).
EAGER_ARCHITECTURES = ("gemma", "qwen3", "mt5", "phi3")


@functools.cache
def _at_full(name: str) -> tuple[int, int, int]:
    """(eager's measured peak, the eager peak fxopt predicts, fxopt's measured peak at 100%)."""
    from benchmarks.hf_breadth import ARCHITECTURES
    from benchmarks.hf_zoo import HFLoss

    torch.manual_seed(0)
    hf, batch = ARCHITECTURES[name]()
    model, inputs = HFLoss(hf, tuple(batch)).train(), tuple(batch.values())
    eager = measured_peak(copy.deepcopy(model), inputs)
    optimized = fxopt.optimize(copy.deepcopy(model), 1.0, time_limit=TIME_LIMIT)
    step(optimized, inputs)  # the first call plans
    return eager, optimized.plan.eager_peak_bytes, measured_peak(optimized, inputs)


@pytest.mark.parametrize("name", EAGER_ARCHITECTURES)
def test_predicted_eager_peak_is_the_measured_one(name):
    """A fraction, and every "% below eager", is of the eager peak fxopt predicts: never below
    the measured one, at most 3% above."""
    eager, predicted, _ = _at_full(name)
    assert 1.0 <= predicted / eager <= 1.03, f"predicted {predicted} B, measured {eager} B"


@pytest.mark.parametrize("name", EAGER_ARCHITECTURES)
def test_at_full_budget_no_more_than_eager(name):
    eager, _, at_full = _at_full(name)
    assert at_full <= eager, f"fxopt at 100% measured {at_full} B, eager {eager} B"


class LossAndLogits(torch.nn.Module):
    """A transformers causal LM called as people call it: labels and a padding mask passed in, the
    output's loss and logits returned, the backward started at the loss."""

    def __init__(self, hf: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.hf, self.names = hf, names

    def forward(self, *inputs):
        out = self.hf(**dict(zip(self.names, inputs)))
        return out.loss, out.logits


def _logits_held(module, inputs):
    loss, logits = module(*inputs)  # (the logits alive through the backward, as a caller's variable keeps them)
    loss.backward()


def _logits_dropped(module, inputs):
    module(*inputs)[0].backward()  # (``model(...).loss.backward()``: the logits freed before the backward)


@pytest.mark.parametrize("arch", [("LlamaConfig", "LlamaForCausalLM"), ("GemmaConfig", "GemmaForCausalLM")])
def test_logits_returned_beside_the_loss_get_no_gradient_in_eager(arch):
    """Issue 24, items 11 and 3: the step is traced with an incoming gradient for the logits it
    returns, which eager's ``loss.backward()`` never makes (nor its sum with the loss's). The
    predicted eager peak counted both: 8% above the measured one on the bench Llama, and fxopt at
    100% measured above eager. Now: within 3% where the caller holds the logits through the
    backward, above it (never below) where the caller drops them first, fxopt at 100% no more
    than eager either way, and a backward started at the logits too (their gradient given) within
    the plan's budget."""
    from benchmarks import hf_zoo

    torch.manual_seed(0)
    hf, named = hf_zoo._llama_like(*arch, "bench", 0.0)
    model, inputs = LossAndLogits(hf, tuple(named)).train(), tuple(named.values())
    eager = {f: measured_peak(copy.deepcopy(model), inputs, f) for f in (_logits_held, _logits_dropped)}
    optimized = fxopt.optimize(copy.deepcopy(model), 1.0, time_limit=TIME_LIMIT)
    _logits_held(optimized, inputs)  # the first call plans
    plan = optimized.plan
    held, dropped = eager[_logits_held], eager[_logits_dropped]
    assert 1.0 <= plan.eager_peak_bytes / held <= 1.03, f"predicted {plan.eager_peak_bytes} B, measured {held} B"
    assert plan.eager_peak_bytes >= dropped
    for f in (_logits_held, _logits_dropped):
        assert measured_peak(optimized, inputs, f) <= eager[f], f.__name__
    grad = torch.randn(*named["input_ids"].shape, hf.config.vocab_size)  # (resident: counted in the peak)

    def logits_too(module, inputs):
        loss, logits = module(*inputs[:-1])
        torch.autograd.backward((loss, logits), (None, inputs[-1]))

    assert measured_peak(optimized, (*inputs, grad), logits_too) <= plan.budget_bytes
