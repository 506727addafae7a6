"""fxopt's promise at the edge: for every solver, at the smallest budget that solver names for a
small model, one real step measures at most the predicted peak, and the prediction is at most the
budget. The smallest budget is where plans are tightest, so where a gap between the simulator
and the generated code shows first (issue 11: a vision transformer from `transformers`).

Each model is captured once; each solver plans on its graph (`fxopt.solvers.solve`) and the plan
is replayed through `fxopt.optimize(..., plan=)` and measured.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fxopt.solvers import DEFAULT_TIME_LIMIT
import fxopt
from fxopt.solvers.plan import Plan
from fxopt.solvers import SOLVERS, solve
from fxopt.solvers.schedule import simulate
from helpers import measured_peak, step

TIME_LIMIT = DEFAULT_TIME_LIMIT  # a safety stop: the solvers' effort is counted, not timed


def _mlp():
    torch.manual_seed(0)
    from fxopt.models import residual_mlp

    return residual_mlp(blocks=3, width=32, batch=64)


def _deit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DeiTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = transformers.DeiTForImageClassification(config)

        def forward(self, pixels, labels):
            return self.vit(pixel_values=pixels, labels=labels).loss

    return Classifier().train(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))


def _llama():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    import benchmarks.hf_zoo  # noqa: F401  (registers the HF models)
    from fxopt.models import MODELS as ZOO_MODELS

    return ZOO_MODELS["hf-llama"]("test")  # padding mask, -100 labels; a buffer the step never reads


MODELS = {"residual_mlp": _mlp, "deit": _deit, "llama": _llama}
SOLVERS_OF = {"llama": ("instant", "save_all")}  # the larger graph: two solvers keep the file short


def _plan(base: Plan, solver: str, budget: int) -> Plan:
    solution = solve(base.graph, budget, solver, time_limit=TIME_LIMIT)
    return Plan.build(
        graph=base.graph, schedule=solution.schedule, budget_bytes=budget, eager_peak_bytes=base.eager_peak_bytes,
        solver=solution.solver, status=solution.status, solve_seconds=solution.solve_seconds,
        fingerprint=base.fingerprint, module_paths=base.module_paths, timeline=solution.timeline,
        lower_bound_cost=solution.lower_bound_cost,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_solver_keeps_its_smallest_budget(name):
    model, inputs = MODELS[name]()
    base = fxopt.plan(model, 1.0, inputs, solver="save_all", compress=False)
    failures = []
    for solver in SOLVERS_OF.get(name, SOLVERS):
        with pytest.raises(fxopt.InfeasibleBudgetError) as err:
            solve(base.graph, 1, solver, time_limit=TIME_LIMIT)
        plan = _plan(base, solver, err.value.min_budget)
        assert plan.peak_bytes <= plan.budget_bytes, solver
        assert simulate(plan.graph, plan.schedule).peak_bytes == plan.peak_bytes
        optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, example_inputs=inputs, plan=plan,
                                   compress=False)
        # The first call compiles; what Dynamo keeps from compiling (a few bytes) is not the step's.
        step(optimized, inputs)
        measured = measured_peak(optimized, inputs)
        if measured > plan.peak_bytes:
            failures.append(f"{solver}: measured {measured} > predicted {plan.peak_bytes} (budget {plan.budget_bytes})")
    assert not failures, "\n".join(failures)


def test_parameters_and_buffers_the_step_never_reads_count():
    """A module's storage the captured graph never reads (HF Llama's ``original_inv_freq``) is
    alive through the step all the same: every predicted peak counts it."""
    torch.manual_seed(0)
    from fxopt.models import residual_mlp

    model, inputs = residual_mlp(blocks=2, width=32, batch=64)
    model.register_buffer("never_read", torch.zeros(64 * 1024))  # 256 KiB
    plan = fxopt.plan(model, 1.0, inputs, solver="save_all", compress=False)
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, example_inputs=inputs, plan=plan,
                               compress=False)
    step(optimized, inputs)
    measured = measured_peak(optimized, inputs)
    assert plan.peak_bytes >= measured > 256 * 1024


@pytest.mark.slow
def test_gradient_accumulation_keeps_every_step_within_the_budget():
    """Steps that start with gradients already there (accumulation: no zero_grad between
    backwards) hold them through the whole step: each such step is planned counting them, its
    fraction is of its own eager peak (held gradients included, as eager measures it: issue 24,
    item 14), every step measures within its budget, and the accumulated gradients are eager's.
    A byte budget that only the first step can meet is refused with a message naming the held
    gradients. (At 0.8 this Llama's accumulating step is out of reach: fxopt's backward hands
    its new gradients back together at its end, beside the held ones, where eager adds each in
    as it is made; 0.9 is within reach of both steps.)"""
    model, inputs = _llama()
    eager, optimized = copy.deepcopy(model), fxopt.optimize(copy.deepcopy(model), 0.9, time_limit=TIME_LIMIT)
    peaks, eager_peaks = [], []
    for _ in range(3):
        eager_peaks.append(fxopt.measure_peak(step, eager, inputs, resident=[eager, inputs]).peak_bytes)
        resident = [optimized, inputs]
        peaks.append(fxopt.measure_peak(step, optimized, inputs, resident=resident).peak_bytes)
    first, accumulating = optimized.plans
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert accumulating.eager_peak_bytes >= first.eager_peak_bytes + held
    for plan, measured in ((first, eager_peaks[0]), (accumulating, eager_peaks[1])):
        assert measured <= plan.eager_peak_bytes <= 1.03 * measured
        assert plan.budget_bytes == int(0.9 * plan.eager_peak_bytes)
    assert peaks[0] <= first.budget_bytes
    assert max(peaks[1:]) <= accumulating.budget_bytes and max(peaks[1:]) > first.budget_bytes - held
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad)

    tight = fxopt.optimize(copy.deepcopy(model), first.peak_bytes, time_limit=TIME_LIMIT)
    step(tight, inputs)
    with pytest.raises(fxopt.InfeasibleBudgetError, match="gradients already there"):
        step(tight, inputs)


@pytest.mark.slow
def test_the_named_minimum_says_which_step_it_holds_for_and_names_accumulations():
    """The smallest budget fxopt names for a step that starts without gradients holds for such
    steps; the error also names the minimum of the steps that start with them held (gradient
    accumulation), and a two-step accumulation loop at that one measures within it on both steps
    (issue 24, item 14: at the first one, the second step needed 23% more)."""
    from fxopt.models import ResidualMLP

    torch.manual_seed(0)
    model, inputs = ResidualMLP(4, 128), (torch.randn(512, 128),)
    with pytest.raises(fxopt.InfeasibleBudgetError, match="gradient accumulation") as err:
        fxopt.plan(copy.deepcopy(model), 1000, inputs, time_limit=TIME_LIMIT)
    first = err.value.min_budget
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    accumulating = first + grads
    assert f"({accumulating} bytes)" in str(err.value)
    loop = fxopt.optimize(copy.deepcopy(model), first, time_limit=TIME_LIMIT)
    step(loop, inputs)
    with pytest.raises(fxopt.InfeasibleBudgetError, match="gradients already there") as held:
        step(loop, inputs)
    assert held.value.min_budget <= accumulating
    loop = fxopt.optimize(copy.deepcopy(model), accumulating, time_limit=TIME_LIMIT)
    step(loop, inputs)  # (each kind of step is planned at its first call: measured after)
    step(loop, inputs)
    loop.zero_grad(set_to_none=True)
    peaks = [fxopt.measure_peak(step, loop, inputs, resident=[loop, inputs]).peak_bytes for _ in range(2)]
    assert max(peaks) <= accumulating


class _ConvMSE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.conv(x), target)


def test_a_loss_holding_more_storage_than_its_shape_says_is_counted():
    """CPU ``mse_loss`` returns its 0-dim mean on the elementwise loss's storage (16 KiB under a
    4-byte scalar here), alive as long as the loss: the predicted peak counts the storage the
    kernel allocated, not the shape's (issue 24: the diffusers UNet measured its output's size
    over the prediction, here 12 KiB over it)."""
    torch.manual_seed(0)
    model, inputs = _ConvMSE(), (torch.randn(4, 4, 16, 16), torch.randn(4, 4, 16, 16))
    optimized = fxopt.optimize(copy.deepcopy(model), 1.0, example_inputs=inputs, compress=False)
    step(optimized, inputs)
    measured = measured_peak(optimized, inputs)
    assert measured <= optimized.plan.peak_bytes, f"measured {measured} B > predicted {optimized.plan.peak_bytes} B"
    loss = optimized.plan.graph.nodes[[n.name for n in optimized.plan.graph.nodes].index("mse_loss")]
    assert loss.bytes == 4 * 4 * 16 * 16 * 4


class _GatherPow(torch.nn.Module):
    """Eager keeps what the traced graph does not read: ``gather`` saves its whole input (its
    traced backward reads only the input's sizes), and ``pow``'s backward formula holds its
    temporaries (``self.pow(1)``, ``2 * self.pow(1)``) until it has run; and the traced
    ``new_zeros`` + ``scatter_add`` of the gather's backward are eager's in-place
    ``scatter_add_``, one buffer (`Node.eager_in_place`)."""

    def __init__(self, wide: bool = True):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.wide = torch.nn.Linear(64, 1024) if wide else torch.nn.Identity()

    def forward(self, x, index):
        kept = torch.gather(self.proj(x), 1, index)  # (64, 2, 64) of (64, 32, 64)
        return (self.wide(kept) - 1).pow(2).mean()


class _ExpandedDropout(torch.nn.Module):
    """XLNet's position embeddings: a dropout that drops nothing of an expanded tensor, read by
    two reshapes. The traced step makes one dense copy at the dropout (`alias_identity_dropouts`
    cannot alias it: its readers' views need the dense layout); eager returns the expanded input
    itself, and each reshape copies it, each copy saved by its matrix product."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(256, 1, 64))
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        pos = self.drop(self.pos.expand(-1, 8, -1))
        return (x + self.a(pos.reshape(-1, 64)) + self.b(pos.reshape(-1, 64))).sum()


class _Gelu(torch.autograd.Function):
    """Bloom's GELU: a custom autograd.Function whose Python backward's temporaries die as Python
    drops them (the formula-end rule of aten formulas would hold them all: 77% over on Bloom)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _PythonGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 512)

    def forward(self, x):
        return _Gelu.apply(self.up(x)).sum()


EAGER_CASES = {
    "gather_pow": (_GatherPow, lambda: (torch.randn(64, 32, 64), torch.randint(0, 32, (64, 2, 64)))),
    # (the gather's backward the peak: its traced new_zeros + scatter_add, eager's one buffer)
    "gather_backward": (lambda: _GatherPow(wide=False), lambda: (torch.randn(64, 32, 64),
                                                                 torch.randint(0, 32, (64, 4, 64)))),
    "expanded_dropout": (_ExpandedDropout, lambda: (torch.randn(2048, 64),)),
    "python_backward": (_PythonGelu, lambda: (torch.randn(512, 64),)),
}


@pytest.mark.parametrize("name", sorted(EAGER_CASES))
def test_the_predicted_eager_peak_counts_what_eager_holds(name):
    """Issue 24, item 11: the eager peak fxopt predicts (what fractions are of) is never below the
    measured one, at most 3% above, where eager holds what the traced graph does not show."""
    torch.manual_seed(0)
    make, make_inputs = EAGER_CASES[name]
    model, inputs = make(), make_inputs()
    eager = measured_peak(copy.deepcopy(model), inputs)
    predicted = fxopt.plan(copy.deepcopy(model), 1.0, inputs, solver="save_all", compress=False).eager_peak_bytes
    assert eager <= predicted <= 1.03 * eager, f"predicted {predicted} B, measured {eager} B"


def test_a_block_freed_on_another_thread_is_freed():
    """A tensor whose last reference another thread drops (gloo's worker thread drops the tensors
    of a collective it ran: a re-gathered parameter, issue 26) is freed in the measured timeline
    as in the allocator, though the profiler records no event on that thread: measured, a step
    that makes four 1 MiB tensors one after another, each let go by a thread, peaks at one."""
    import threading

    mib = 1 << 20

    def step_handing_off():
        for _ in range(4):
            box = [torch.ones(mib // 4)]
            thread = threading.Thread(target=box.clear)
            thread.start()
            thread.join()

    peak = fxopt.measure_peak(step_handing_off, device="cpu")
    assert mib <= peak.increase_bytes < 2 * mib, peak
