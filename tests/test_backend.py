"""fxopt as a torch.compile backend: by name (entry point) and configured, with the eager and
the Inductor compiler; the measured peak stays within the budget and the step equals eager's;
graph breaks and dynamic shapes get a clear error (or, asked for, a warning)."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.capture.dynamo import unwrap_compile_error
from fxopt import GraphBreakWarning
from fxopt.models import residual_mlp, transformer_block
from helpers import measured_peak, step

# Small enough that Inductor compiles each step in seconds on 2 cores, activation-dominated
# enough that half the eager peak is reachable for the MLP (the transformer block's smallest
# plan is about 80% of its eager peak: see test_transformer_block).
MODELS = {
    "residual_mlp": lambda: residual_mlp(blocks=6, width=64, batch=1024),
    "transformer_block": lambda: transformer_block(batch=4, seq=128, dim=64, heads=4),
}
# Inductor sums in another order than eager's kernels: equal up to float rounding.
TOLERANCE = {"eager": {}, "inductor": {"rtol": 1e-4, "atol": 1e-5}}
# Bytes Inductor's kernels may hold beyond the plan's prediction (never beyond the budget).
INDUCTOR_SLACK_BYTES = 4096


def compiled_step(model, inputs, backend, seed=1):
    compiled = torch.compile(model, backend=backend, dynamic=False)
    torch.manual_seed(seed)
    try:
        loss = step(compiled, inputs)
    except Exception as err:  # Dynamo wraps what the backend raises
        raise (unwrap_compile_error(err) or err) from None
    return compiled, loss


def check_step(name, compiler, budget):
    """Compile `name` with fxopt at `budget` (or at the smallest budget fxopt names, if that one
    is infeasible); check parity with eager and the measured peak. Returns the plan."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    backend = fxopt.backend(budget, compiler=compiler, time_limit=5)
    try:
        compiled, loss_o = compiled_step(model, inputs, backend)
    except fxopt.InfeasibleBudgetError as err:
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        backend = fxopt.backend(err.min_budget, compiler=compiler, time_limit=5)
        compiled, loss_o = compiled_step(model, inputs, backend)
    (plan,) = backend.plans
    tol = TOLERANCE[compiler]
    torch.testing.assert_close(loss_o, loss_e, **tol)
    for (pname, p_e), p_o in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad, **tol, msg=lambda m: f"grad of {pname}: {m}")
    measured = measured_peak(_Step(compiled, model), inputs)
    assert measured <= plan.budget_bytes, (compiler, measured, plan.budget_bytes)
    # The prediction bounds the generated code; Inductor's kernels may hold a few hundred bytes the
    # graph does not show (seen: 256 bytes over on the residual MLP, 0.01%), within the budget.
    slack = INDUCTOR_SLACK_BYTES if compiler == "inductor" else 0
    assert measured <= plan.peak_bytes + slack, (compiler, measured, plan.peak_bytes)
    return plan


class _Step(nn.Module):
    """The compiled callable with the original's parameters, for `measured_peak`."""

    def __init__(self, compiled, model):
        super().__init__()
        self.model = model
        self.__dict__["compiled"] = compiled

    def forward(self, *args):
        return self.compiled(*args)


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_residual_mlp_at_half_the_eager_peak(compiler):
    """With Inductor, half of Inductor's own step's measured peak (its fused kernels keep less)."""
    plan = check_step("residual_mlp", compiler, 0.5)
    of = plan.eager_peak_bytes if compiler == "eager" else plan.compiled_peak_bytes
    assert plan.budget_bytes == int(0.5 * of)
    assert plan.recomputed


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_transformer_block(compiler):
    """Half its eager peak is below what any schedule reaches (the attention matrix, its softmax
    and their gradients are alive together in one op's backward): the error names the smallest
    budget, and at that budget the step fits."""
    with pytest.raises(fxopt.InfeasibleBudgetError):
        torch.manual_seed(0)
        model, inputs = MODELS["transformer_block"]()
        compiled_step(model, inputs, fxopt.backend(0.5, compiler=compiler, time_limit=5))
    torch._dynamo.reset()
    plan = check_step("transformer_block", compiler, 0.5)
    assert plan.budget_bytes > 0.5 * plan.eager_peak_bytes
    assert plan.peak_bytes < plan.eager_peak_bytes


@pytest.mark.slow
def test_entry_point_works_without_importing_fxopt(tmp_path):
    """``backend="fxopt"`` resolves through the torch_dynamo_backends entry point in a fresh
    interpreter that never imports fxopt itself; options= reach the planner."""
    script = tmp_path / "use_backend.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        import torch.nn as nn

        assert "fxopt" not in sys.modules
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)])
        x = torch.randn(512, 64)
        compiled = torch.compile(model, backend="fxopt", dynamic=False,
                                 options={"budget": 0.9, "compiler": "eager", "solver": "greedy"})
        compiled(x).sum().backward()
        from torch._dynamo.backends.registry import lookup_backend
        import fxopt.capture.backend
        assert lookup_backend("fxopt") is fxopt.capture.backend.fxopt_backend
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters()))
        print("ok")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_entry_point_options_are_checked():
    from fxopt.capture.backend import fxopt_backend

    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a budget"):
        fxopt_backend(gm, [], options={})
    with pytest.raises(ValueError, match="unknown fxopt option.*'budgte'"):
        fxopt_backend(gm, [], options={"budgte": 0.5})
    with pytest.raises(ValueError, match="takes no mode"):
        fxopt_backend(gm, [], options={"budget": 0.5}, mode="max-autotune")
    with pytest.raises(fxopt.BudgetError):
        fxopt.backend("3 potatoes")
    with pytest.raises(ValueError, match="unknown compiler"):
        fxopt.backend(0.5, compiler="tvm")
    with pytest.raises(ValueError, match="graph_breaks"):
        fxopt.backend(0.5, graph_breaks="ignore")


def test_backend_replays_a_given_plan_without_solving(tmp_path, monkeypatch):
    """``fxopt.backend(plan=...)`` (here the path of a plan's JSON) runs that plan: nothing is
    solved and the step equals eager's; a plan for another graph is refused."""
    import fxopt.planner as planner

    torch.manual_seed(0)
    model, inputs = residual_mlp(blocks=3, width=32, batch=512)
    plan = fxopt.plan(model, 0.8, inputs, solver="greedy")
    assert plan.recomputed
    plan.to_json(tmp_path / "plan.json")
    solves = []
    monkeypatch.setattr(planner, "solve", lambda *a, **k: solves.append(1))
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    backend = fxopt.backend(0.8, compiler="eager", plan=str(tmp_path / "plan.json"))
    _, loss = compiled_step(model, inputs, backend)
    assert not solves
    assert [p.to_dict() for p in backend.plans] == [plan.to_dict()]
    torch.testing.assert_close(loss, loss_e)
    for p_e, p_o in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad)
    torch._dynamo.reset()
    with pytest.raises(fxopt.CaptureError, match="different graph"):
        compiled_step(model, (inputs[0][:256],), fxopt.backend(0.8, compiler="eager", plan=plan))


class BreaksInTheMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 0:  # data-dependent: Dynamo splits the graph here
            h = h * 2
        return self.b(h).sum()


def test_graph_break_is_refused_with_its_location():
    torch.manual_seed(0)
    model, x = BreaksInTheMiddle(), torch.randn(64, 32)
    with pytest.raises(fxopt.CaptureError) as info:
        compiled_step(model, (x,), fxopt.backend(0.9, compiler="eager"))
    message = str(info.value)
    assert "graph break" in message and "test_backend.py" in message
    assert "fullgraph=True" in message and "graph_breaks" in message


def test_graph_break_warns_and_plans_each_piece_when_asked():
    torch.manual_seed(0)
    model, x = BreaksInTheMiddle(), torch.randn(64, 32)
    eager = copy.deepcopy(model)
    backend = fxopt.backend(1.0, compiler="eager", graph_breaks="warn")
    with pytest.warns(GraphBreakWarning, match="not bounded"):
        _, loss = compiled_step(model, (x,), backend)
    assert len(backend.plans) == 2
    loss_e = step(eager, (x,))
    torch.testing.assert_close(loss, loss_e)
    for p_e, p_o in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad)


def test_dynamic_shapes_are_refused_with_the_fix():
    torch.manual_seed(0)
    model, inputs = MODELS["residual_mlp"]()
    compiled = torch.compile(model, backend=fxopt.backend(0.9, compiler="eager"), dynamic=True)
    with pytest.raises(Exception) as info:
        step(compiled, inputs)
    err = unwrap_compile_error(info.value)
    assert isinstance(err, fxopt.CaptureError) and "dynamic=False" in str(err)


@pytest.mark.slow
def test_inductor_keeps_a_vision_transformer_within_its_smallest_budget():
    """Inductor's layout optimization made channels-last copies of the patch embedding's input and
    weight and saved them for the backward: +69632 B over the prediction on this ViT (issue 11)."""
    pytest.importorskip("transformers")
    import benchmarks.hf_zoo  # noqa: F401  (registers the HF models)
    from fxopt.models import MODELS as ZOO_MODELS

    torch.manual_seed(0)
    model, inputs = ZOO_MODELS["hf-vit"]("test")
    with pytest.raises(fxopt.InfeasibleBudgetError) as err:
        fxopt.plan(model, 1, inputs, solver="instant", compiler="inductor")
    optimized = fxopt.optimize(copy.deepcopy(model), err.value.min_budget, example_inputs=inputs,
                               solver="instant", compiler="inductor")
    step(optimized, inputs)  # the first call compiles
    measured = measured_peak(optimized, inputs)
    assert measured <= optimized.plan.peak_bytes <= optimized.plan.budget_bytes


class _LanguageModelLoss(nn.Module):
    """A transformers causal LM called the way its users call it, with ``labels=``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


@pytest.mark.slow
def test_a_library_model_whose_loss_logs_compiles_as_one_step():
    """GPT-2's loss path logs (``logger.warning_once``): without fxopt's logging switches that is a
    graph break, and the backend refused the step (issue 24, item 13). By name, as users write it:
    one graph, within the budget, the step equal to eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = _LanguageModelLoss(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, 512, (4, 32))
    eager = copy.deepcopy(model)
    budget = int(0.8 * measured_peak(copy.deepcopy(model), (ids, ids)))
    compiled = torch.compile(model, backend="fxopt", dynamic=False,
                             options={"budget": budget, "compiler": "eager", "time_limit": 10})
    torch.manual_seed(1)
    loss = compiled(ids, labels=ids)
    loss.backward()
    torch.manual_seed(1)
    loss_e = eager(ids, labels=ids)
    loss_e.backward()
    torch.testing.assert_close(loss, loss_e)
    for (name, p_e), p_o in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad, msg=lambda m: f"grad of {name}: {m}")
    assert measured_peak(_Step(compiled, model), (ids, ids)) <= budget


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama"])  # (GPT-2 in benchmarks/inductor_peak: each Inductor compile takes minutes on 2 cores)
def test_inductor_holds_the_library_checkpointing_peak(name):
    """At transformers' own gradient checkpointing's measured peak, fxopt + Inductor measures
    within its prediction and its budget, gradients as eager's (issue 24, item 2: the bench Llama
    was reported at 44.6 MiB against a 42.3 MiB budget)."""
    pytest.importorskip("transformers")
    import benchmarks.hf_zoo  # noqa: F401  (registers the HF models)
    from fxopt.models import MODELS as ZOO_MODELS

    torch.manual_seed(0)
    model, inputs = ZOO_MODELS[name]("test")
    checkpointed = copy.deepcopy(model)
    ZOO_MODELS[name].checkpointing(checkpointed, True)
    budget = measured_peak(checkpointed, inputs)
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, compiler="inductor")
    torch.manual_seed(1)
    expected = step(eager, inputs)
    torch.manual_seed(1)
    torch.testing.assert_close(step(optimized, inputs), expected, **TOLERANCE["inductor"])  # the first call compiles
    for (path, p), q in zip(eager.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOLERANCE["inductor"], msg=lambda m, path=path: f"grad of {path}: {m}")
    measured = measured_peak(optimized, inputs)
    assert measured <= optimized.plan.budget_bytes == budget  # the promise, on every torch
    # Never below the measurement (issue 24): 269,780 B against a prediction of 269,520 before
    # nll_loss's backward's scatter was counted and the fusion guard judged against a peak a run
    # reaches (`test_inductor_through_the_plan_holds_what_the_simulator_predicts`); 267,084 against
    # 267,804 after.
    assert measured <= optimized.plan.peak_bytes


def test_inductor_counts_the_reductions_an_ops_decomposition_writes():
    """Inductor decomposes a log-softmax into a per-row maximum, a sum and a log, which it writes
    to memory (the eager kernel the simulator measures holds none of them): planned for Inductor,
    the op's workspace holds them (`fxopt.passes.decompose.reduction_scratch`; on a transformers
    GPT-2 at bench size, 6,144 B at its eager peak, measured above the plan before). A pointwise op
    and an op Inductor does not decompose hold none."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.passes.decompose import reduction_scratch

    def scratch(fn, *inputs):
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
        return reduction_scratch(next(n for n in gm.graph.nodes if n.op == "call_function"), select_decomp_table())

    rows = 8
    assert scratch(lambda x: torch.ops.aten._log_softmax(x, -1, False), torch.randn(rows, 16)) == 3 * rows * 4
    assert scratch(lambda x: torch.ops.aten.relu(x), torch.randn(rows, 16)) == 0
    assert scratch(lambda x, w: torch.ops.aten.mm(x, w), torch.randn(rows, 16), torch.randn(16, 4)) == 0
    # A mean, lowered as a sum then a division, holds the sum.
    assert scratch(lambda x: torch.ops.aten.mean.dim(x, [-1], True), torch.randn(rows, 16)) == rows * 4
    # A decomposition that makes a constant (nll_loss's zero for ignored targets) is traced too.
    targets = torch.randint(0, 16, (rows,))
    assert scratch(lambda x, y: torch.ops.aten.nll_loss_forward(x, y, None, 1, -100), torch.randn(rows, 16), targets) > 0
    # nll_loss's backward scatters into zeros as large as the logits, then scales them into its
    # output: Inductor writes both, eager's kernel one (the test-size transformers Llama measured
    # 260 B over the plan at 1.0 with the targets it reads).
    logits = torch.randn(rows, 16)
    backward = scratch(lambda g, x, y, w: torch.ops.aten.nll_loss_backward(g, x, y, None, 1, -100, w),
                       torch.tensor(1.0), logits, targets, torch.tensor(float(rows)))
    assert backward >= logits.nbytes


def test_a_kernel_may_write_its_output_into_an_input_that_dies_there():
    """`_KernelMemory`'s peak is the least kernels run one by one hold: a kernel may write an output
    into a buffer or input of the same bytes that dies there (Inductor's in-place reuse), one
    each; what the count frees there is then not freed (the output holds it)."""
    from fxopt.capture.inductor import _reusable

    assert _reusable([16384, 128], [(16384, True), (256, True)]) == (16384, 16384)
    assert _reusable([16384, 16384], [(16384, False)]) == (16384, 0)  # (a held input: nothing freed)
    assert _reusable([128], [(256, True)]) == (0, 0)
    assert _reusable([0], [(0, True)]) == (0, 0)


@pytest.mark.slow
def test_inductor_through_the_plan_holds_what_the_simulator_predicts():
    """Through fxopt's plan (Inductor's own step set aside), the test-size transformers Llama at its
    eager peak measured 260 B over the prediction: nll_loss's backward wrote two logits-sized
    buffers (a scatter's, then its output) where the simulator counted one, and its last kernel
    fused with the log-softmax backward's reduction, which the fusion guard allowed against a peak
    no run reached (the log-softmax's gradient is written into the nll_loss gradient in place)."""
    pytest.importorskip("transformers")
    import benchmarks.hf_zoo  # noqa: F401  (registers the HF models)
    from fxopt.capture import dynamo
    from fxopt.models import MODELS as ZOO_MODELS

    torch.manual_seed(0)
    model, inputs = ZOO_MODELS["hf-llama"]("test")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamo, "own_step_bound", lambda *args: None, raising=False)
        optimized = fxopt.optimize(copy.deepcopy(model), 1.0, example_inputs=inputs, compiler="inductor")
        eager = copy.deepcopy(model)
        torch.manual_seed(1)
        expected = step(eager, inputs)
        torch.manual_seed(1)
        _assert_step_close(eager, optimized, expected, step(optimized, inputs))
    measured = measured_peak(optimized, inputs)
    assert measured <= optimized.plan.peak_bytes <= optimized.plan.budget_bytes


def _inductor_step(model, inputs, budget, caplog):
    """``model`` (a copy) optimized at ``budget`` with Inductor, its first step run; the step,
    its loss and fxopt's log of that first call."""
    import logging

    optimized = fxopt.optimize(copy.deepcopy(model), budget, compiler="inductor")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fxopt"):
        torch.manual_seed(1)
        loss = step(optimized, inputs)
    return optimized, loss, caplog.text


@pytest.mark.slow
def test_inductor_at_1_0_runs_inductors_own_step(caplog):
    """At budget 1.0 fxopt + Inductor is torch.compile's own step (its partitioner, its fusions and
    reorders, none of fxopt's restrictions: issue 28), measured within the budget before it runs:
    the same peak as ``torch.compile(model)``'s, the step equal to eager's. With Inductor a
    fraction is of that step's measured peak."""
    torch.manual_seed(0)
    model, inputs = MODELS["residual_mlp"]()
    optimized, loss, told = _inductor_step(model, inputs, 1.0, caplog)
    assert "running Inductor's own step" in told
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    _assert_step_close(eager, optimized, step(eager, inputs), loss)
    plain = copy.deepcopy(model)
    compiled = torch.compile(plain)
    step(compiled, inputs)
    measured = measured_peak(optimized, inputs)
    assert measured == measured_peak(_Step(compiled, plain), inputs)
    assert measured <= optimized.plan.budget_bytes == optimized.plan.compiled_peak_bytes
    assert "plain Inductor's" in optimized.plan.summary()


@pytest.mark.slow
def test_inductor_fraction_is_a_share_of_the_compiled_steps_peak(caplog):
    """With Inductor, 0.7 is 70% of what ``torch.compile(model)``'s own step measures (below
    eager's: its fused kernels write fewer intermediates), not of eager's predicted peak; fxopt's
    plan runs there, within it, with eager's gradients."""
    torch.manual_seed(0)
    model, inputs = MODELS["residual_mlp"]()
    optimized, loss, told = _inductor_step(model, inputs, 0.7, caplog)
    plan = optimized.plan
    plain = copy.deepcopy(model)
    compiled = torch.compile(plain)
    step(compiled, inputs)
    assert plan.compiled_peak_bytes == measured_peak(_Step(compiled, plain), inputs) < plan.eager_peak_bytes
    assert plan.budget_bytes == int(0.7 * plan.compiled_peak_bytes)
    assert "running Inductor's own step" not in told
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    _assert_step_close(eager, optimized, step(eager, inputs), loss)
    assert measured_peak(optimized, inputs) <= plan.budget_bytes


@pytest.mark.slow
def test_inductors_own_step_over_the_budget_gives_way_to_the_plan(caplog, monkeypatch):
    """Where Inductor's own step measures over what the budget leaves it, fxopt's plan is compiled
    instead, from the modules it already made (one plan, not two), and the budget holds. (A budget
    in bytes above eager's peak: a fraction would be of what the own step measured.)"""
    from fxopt.capture import inductor

    monkeypatch.setattr(inductor, "_run_increase", lambda compiled, example_inputs: 1 << 40)
    torch.manual_seed(0)
    model, inputs = MODELS["residual_mlp"]()
    optimized, loss, told = _inductor_step(model, inputs, "1GiB", caplog)
    assert "compiling fxopt's plan instead" in told and "running Inductor's own step" not in told
    assert len(optimized.plans) == 1 and optimized.plan.compiled_peak_bytes is None
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    _assert_step_close(eager, optimized, step(eager, inputs), loss)
    measured = measured_peak(optimized, inputs)
    assert measured <= optimized.plan.peak_bytes + INDUCTOR_SLACK_BYTES
    assert measured <= optimized.plan.budget_bytes


@pytest.mark.slow
def test_measuring_inductors_own_step_changes_no_state(caplog):
    """Inductor's own step is run to be measured before the first call's step runs: the batch
    norms' running statistics it updates and the random state it advances are put back, so after
    the first call they are as after one eager step."""
    from fxopt.models import cnn_bn

    torch.manual_seed(0)
    model, inputs = cnn_bn(batch=4, size=16, channels=8)
    optimized, loss, told = _inductor_step(model, inputs, 1.0, caplog)
    assert "Inductor's own step" in told  # (measured: run, or given way to the plan)
    after = torch.rand(4)
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    _assert_step_close(eager, optimized, step(eager, inputs), loss)
    torch.testing.assert_close(after, torch.rand(4))
    for (name, b_e), b_o in zip(eager.named_buffers(), optimized.buffers()):
        torch.testing.assert_close(b_o, b_e, **TOLERANCE["inductor"], msg=lambda m, name=name: f"buffer {name}: {m}")


def _assert_step_close(eager, optimized, loss_e, loss_o):
    torch.testing.assert_close(loss_o, loss_e, **TOLERANCE["inductor"])
    for (name, p_e), p_o in zip(eager.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad, **TOLERANCE["inductor"], msg=lambda m, name=name: f"grad of {name}: {m}")


def test_a_random_op_that_draws_nothing_does_not_keep_inductors_own_step_out():
    """Inductor's own step is not offered for a step whose random ops draw (fxopt's modules keep
    eager's draws, Inductor's own would not), but CPU attention, a random op by its tags, draws
    nothing at ``dropout_p=0`` (every transformers model with dropout 0)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.capture.dynamo import _draws

    def ops(x, q):
        a = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0]
        b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.1)[0]
        c = torch.ops.aten.native_dropout(x, 0.5, True)[0]
        return a, b, c, torch.rand_like(x), x.relu()

    gm = make_fx(ops, tracing_mode="fake")(torch.randn(4, 8), torch.randn(1, 2, 4, 8))
    draws = {n.target: _draws(n) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
             and n.target is not torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    sdpa = [_draws(n) for n in gm.graph.nodes
            if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert sdpa == [False, True]
    assert draws[torch.ops.aten.native_dropout.default] and draws[torch.ops.aten.rand_like.default]
    assert not draws[torch.ops.aten.relu.default]


@pytest.mark.slow
# (a cached compile decides nothing; the config's own patch, since pytest 9's monkeypatch deletes a
# torch config entry on undo, which hides it for the rest of the process)
@torch.compiler.config.patch(force_disable_caches=True)
def test_inductors_heuristics_are_each_compiles_own(monkeypatch):
    """Inductor makes its heuristics (which kernels fuse) once per thread, at the first compile,
    from the settings then, and keeps them: a process that had compiled a plain torch.compile first
    compiled fxopt's modules with no fusion guard (the bench transformers Llama at HF
    checkpointing's peak measured 44.65 MiB against its 42.30 MiB budget; 42.18 alone), and plain
    compiles after fxopt's ran under fxopt's guard. Each compile now gets its own. The guard of
    fxopt's backward knows which of its inputs die there: the partition's marks reach Inductor's
    scheduler (without them no kernel of the backward would fuse)."""
    from fxopt.capture import inductor

    guarded, marks = [], []
    original = inductor._KeepSchedule.can_fuse_horizontal
    monkeypatch.setattr(inductor._KeepSchedule, "can_fuse_horizontal",
                        staticmethod(lambda *args: guarded.append(1) or original(*args)))
    read_marks = inductor._held_marks
    monkeypatch.setattr(inductor, "_held_marks", lambda gm: marks.append(read_marks(gm)) or marks[-1])
    torch.manual_seed(0)
    model, inputs = MODELS["residual_mlp"]()
    step(torch.compile(copy.deepcopy(model)), inputs)
    assert not guarded
    optimized = fxopt.optimize(copy.deepcopy(model), 0.5, example_inputs=inputs, compiler="inductor")
    step(optimized, inputs)
    assert optimized.plan.recomputed and guarded  # (fxopt's modules, compiled under its guard)
    assert marks and all(held is not None for held in marks)
    guarded.clear()
    torch._dynamo.reset()
    step(torch.compile(copy.deepcopy(model)), inputs)
    assert not guarded


class _GatedBlock(nn.Module):
    """A residual MLP block whose activation is a chain of pointwise ops between two matrix
    products: recomputing the chain from the first product's output, or that product, is the choice."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(torch.tanh(h) * torch.sigmoid(h) + h)


@pytest.mark.slow  # two Inductor compiles and plans: 45-100 s on 2 cores
def test_inductor_recomputes_fused_pointwise_ops_instead_of_matrix_products():
    """A pointwise op priced as fused into the kernel that reads it
    (`fxopt.analysis.CostModel.fused_pointwise`, issue 28): at 70% of eager's peak the plan
    recomputes pointwise chains only, no FLOPs counted, where the op-by-op pricing (the default)
    recomputes matrix products at the same budget. The two pricings' plans are cached apart, and
    the fused plan's step holds its budget under Inductor, measured, with eager's gradients."""
    from fxopt import cache
    from fxopt.analysis import CostModel

    torch.manual_seed(0)
    model, inputs = nn.Sequential(*[_GatedBlock(32) for _ in range(4)]), (torch.randn(512, 32),)
    budget = int(0.7 * fxopt.plan(model, 1.0, inputs).eager_peak_bytes)  # (bytes: with Inductor 0.7 is of its own step)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, compiler="inductor",
                               cost_model=CostModel(fused_pointwise=True))

    def recomputed(plan, op_class):
        classes = {n.name: n.op_class for n in plan.graph.nodes}
        return sum(t for name, t in plan.recomputed.items() if classes[name] == op_class)

    fused = optimized.plan
    assert fused.recompute_flops == 0 and recomputed(fused, "matmul") == 0
    unfused = fxopt.plan(model, budget, inputs, compiler="inductor")
    assert recomputed(fused, "pointwise") > recomputed(unfused, "pointwise") > 0
    assert recomputed(unfused, "matmul") > 0 and unfused.recompute_flops > 0
    assert cache.key(fused.graph, fused.budget_bytes, "auto") != cache.key(unfused.graph, unfused.budget_bytes, "auto")
    eager = copy.deepcopy(model)
    _assert_step_close(eager, optimized, step(eager, inputs), step(optimized, inputs))
    assert measured_peak(optimized, inputs) <= fused.budget_bytes
