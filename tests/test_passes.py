"""Graph passes: dropout's output recomputed from its mask is bit-identical to eager's."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.passes.dropout import recompute_dropout_from_mask
from helpers import measured_peak, step


class DropNet(nn.Module):
    def __init__(self, width=64, p=0.3):
        super().__init__()
        self.l1, self.l2, self.p = nn.Linear(width, width), nn.Linear(width, width), p

    def forward(self, x):
        h = F.dropout(torch.tanh(self.l1(x)), self.p, self.training)
        return (self.l2(h) * h).sum()  # h is read by the backward of the product and of l2


@pytest.mark.parametrize("budget", [1.0, "min"])
def test_dropout_from_mask_is_bit_identical(budget):
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(2048, 64)
    if budget == "min":  # the smallest budget fxopt reaches: dropout's output is recomputed
        with pytest.raises(fxopt.InfeasibleBudgetError) as info:
            fxopt.plan(model, 1000, (x,))
        budget = info.value.min_budget
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=(x,))
    torch.manual_seed(3)
    loss_e = step(eager, (x,))
    torch.manual_seed(3)
    loss_o = step(optimized, (x,))
    assert torch.equal(loss_e, loss_o)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        assert torch.equal(p_e.grad, p_o.grad)
    # The float output of dropout is not SAVEd: only its boolean mask is, or nothing at all.
    plan = optimized.plan
    saved = [plan.graph.nodes[[n.name for n in plan.graph.nodes].index(name)] for name in plan.saved]
    assert not any(n.name.startswith("native_dropout") for n in saved)


def _joint_with_dropout(dtype):
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def compiler(gm, _):
        graphs.append(gm)
        return gm

    def f(x):
        return torch.ops.aten.native_dropout(x, 0.5, True)[0] * 2

    x = torch.randn(8, 8, dtype=dtype, requires_grad=True)
    aot_function(f, fw_compiler=compiler, bw_compiler=compiler)(x)
    return graphs[0]


def test_dropout_pass_rewrites_float32_and_leaves_bfloat16():
    assert recompute_dropout_from_mask(_joint_with_dropout(torch.float32)) == 1
    assert recompute_dropout_from_mask(_joint_with_dropout(torch.bfloat16)) == 0


class ReluNet(nn.Module):
    """The outer ReLU's output is read in the backward only by ReLU's own backward."""

    def __init__(self, width=64):
        super().__init__()
        self.l1, self.l2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.l2(torch.relu(self.l1(x)))) + x
        return x.sum()


@pytest.mark.parametrize("budget", [1.0, "min"])
def test_relu_mask_is_bit_identical_and_smaller(budget):
    torch.manual_seed(0)
    model, x = ReluNet(), torch.randn(2048, 64)
    if budget == "min":
        with pytest.raises(fxopt.InfeasibleBudgetError) as info:
            fxopt.plan(model, 1000, (x,))
        budget = info.value.min_budget
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=(x,))
    loss_e, loss_o = step(eager, (x,)), step(optimized, (x,))
    assert torch.equal(loss_e, loss_o)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        assert torch.equal(p_e.grad, p_o.grad)
    plan = optimized.plan
    if budget == 1.0:
        # Saving everything the backward reads: the outer ReLUs' outputs (2048 x 64 floats) are not
        # among them any more, their bool masks (2048 x 64 bytes) are; the peak is lower than
        # with compression turned off, where ReLU's backward reads its float output.
        names = [n.name for n in plan.graph.nodes]
        assert any(n.startswith("where") for n in names), "threshold_backward was not rewritten"
        assert len([n for n in plan.saved if n.startswith("le")]) == 3
        without = fxopt.plan(model, 1.0, (x,), compress=False)
        assert not any(n.startswith("le") for n in without.saved)
        assert plan.peak_bytes < without.peak_bytes


def test_value_saved_only_for_a_dead_recomputation_is_not_saved(monkeypatch):
    """A recomputation nothing reads is dropped from the generated backward; a SAVEd value only it
    read must then not be saved either: an unused backward input is never freed by FX's code,
    while the simulator frees it as the backward starts."""
    import fxopt.capture.dynamo as capture
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.passes.recompute import split_with_recompute
    from fxopt.solvers.schedule import Schedule, simulate

    joints = []
    real_split = capture.split_with_recompute

    def spy(jg, schedule):
        joints.append(jg)
        return real_split(jg, schedule)

    monkeypatch.setattr(capture, "split_with_recompute", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    ready = plan_and_rewrite(model, 1.0, (x,), solver="save_all", compress=False)
    jg, graph = joints[-1], ready.plan.graph
    names = [n.name for n in graph.nodes]
    relu = names.index("relu")
    pre = graph.nodes[relu].inputs[0]  # the first linear's output, which ReLU's backward does not read
    assert pre not in ready.plan.schedule.saved
    # Save it, and recompute ReLU from it once more at the very end, where nothing reads the copy.
    schedule = Schedule(ready.plan.schedule.saved | {pre}, ready.plan.schedule.backward + (relu,))
    simulate(graph, schedule)  # valid
    fw, bw = split_with_recompute(jg, schedule)
    unused = [n.name for n in bw.graph.find_nodes(op="placeholder") if not n.users]
    assert unused == []
    assert names[pre] not in [n.name for n in bw.graph.find_nodes(op="placeholder")]


class Embedder(nn.Module):
    """Returns its normalised embeddings and a similarity loss on them (CLIP's shape): the
    backward of the loss reads the returned embeddings, a forward output."""

    def __init__(self, width=64):
        super().__init__()
        self.l1, self.l2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        e = self.l2(torch.relu(self.l1(x)))
        e = e / e.norm(dim=-1, keepdim=True)
        return e, (e @ e.T).logsumexp(-1).mean()


def test_the_backward_reads_a_forward_output_it_does_not_save():
    """A forward output the backward reads is passed to it like a parameter: the caller holds it,
    and the simulator counts it available, so a plan need not SAVE it (the instant program's
    plan for a transformers CLIP did not, and the backward could not be built)."""
    import dataclasses

    from fxopt.solvers.plan import Plan
    from fxopt.solvers.schedule import simulate

    torch.manual_seed(0)
    model, x = Embedder(), torch.randn(256, 64)
    base = fxopt.plan(model, 1.0, (x,))
    outputs = base.graph.forward_outputs & base.graph.needed_by_backward
    assert outputs  # the backward reads the returned embeddings
    schedule = dataclasses.replace(base.schedule, saved=base.schedule.saved - outputs)
    timeline = simulate(base.graph, schedule)  # valid: outputs are available to the backward
    plan = Plan.build(graph=base.graph, schedule=schedule, budget_bytes=base.budget_bytes,
                      eager_peak_bytes=base.eager_peak_bytes, solver="test", status="heuristic", solve_seconds=0.0,
                      fingerprint=base.fingerprint, module_paths=base.module_paths)
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), base.budget_bytes, plan=plan)
    out_e, out_o = eager(x), optimized(x)
    out_e[1].backward()
    out_o[1].backward()
    torch.testing.assert_close(out_o[0], out_e[0])
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad)
    assert timeline.peak_bytes <= plan.budget_bytes


class _LMHead(nn.Module):
    """A language model's head: the logits (tokens x vocabulary) are the widest values."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.head = nn.Linear(64, 512)

    def forward(self, x, y):
        return F.cross_entropy(self.head(F.dropout(torch.tanh(self.l1(x)), 0.1, self.training)), y)


@pytest.mark.parametrize("budget", [1.0, "min"])
def test_loss_backward_in_place_is_bit_equal_and_a_logits_lower(budget):
    """The cross-entropy's backward held the log-probabilities, its incoming gradient and its
    result at once (three logits, 512 KiB each); written over its incoming gradient
    (`fxopt.passes.loss`, the ``loss_in_place`` default) it holds two: the peak, predicted and
    measured alike, falls by a logits' bytes at full budget and at the smallest, and the loss and
    every gradient (ignored rows and dropout among them) are bit-equal to eager's and to the step
    planned without the rewrite."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 32), torch.randint(0, 512, (256,))
    y[::7] = -100
    inputs, logits = (x, y), 256 * 512 * 4
    torch.manual_seed(0)
    model = _LMHead()

    def run(in_place: bool):
        planned_at = budget
        if budget == "min":
            with pytest.raises(fxopt.InfeasibleBudgetError) as info:
                fxopt.plan(copy.deepcopy(model), 1, inputs, loss_in_place=in_place)
            planned_at = info.value.min_budget
        optimized = fxopt.optimize(copy.deepcopy(model), planned_at, example_inputs=inputs, loss_in_place=in_place)
        torch.manual_seed(3)
        loss = step(optimized, inputs)
        grads = [p.grad.clone() for p in optimized.parameters()]
        return optimized.plan, measured_peak(optimized, inputs), loss.detach(), grads

    off, off_measured, off_loss, off_grads = run(False)
    on, on_measured, on_loss, on_grads = run(True)
    assert any(n.name.startswith("_log_softmax_backward_data_out") for n in on.graph.nodes)
    assert not any(n.name.startswith("_log_softmax_backward_data_out") for n in off.graph.nodes)
    assert on_measured == on.peak_bytes and off_measured == off.peak_bytes, (on_measured, on.peak_bytes,
                                                                             off_measured, off.peak_bytes)
    assert on.peak_bytes <= off.peak_bytes - logits + 16, (on.peak_bytes, off.peak_bytes)
    eager = copy.deepcopy(model)
    torch.manual_seed(3)
    eager_loss = step(eager, inputs)
    assert torch.equal(on_loss, eager_loss) and torch.equal(on_loss, off_loss)
    for p, g_on, g_off in zip(eager.parameters(), on_grads, off_grads, strict=True):
        assert torch.equal(g_on, p.grad) and torch.equal(g_on, g_off)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("classes", [1000, 50257])  # (CUDA's warp kernel up to 1024 columns, its block kernel beyond)
def test_loss_backward_in_place_kernel_is_bit_equal_on_cuda(classes):
    """`fxopt.passes.loss` runs CUDA's log-softmax backward with its result over its incoming
    gradient: each row read before it is written, so bit-equal to the kernel writing a new tensor."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    lsm = torch.log_softmax(torch.randn(512, classes, device="cuda"), 1)
    target = torch.randint(0, classes, (512,), device="cuda")
    target[::7] = -100
    total = (target != -100).sum().float()
    grad = aten.nll_loss_backward(torch.tensor(1.0, device="cuda"), lsm, target, None, 1, -100, total)
    expected = aten._log_softmax_backward_data(grad, lsm, 1, torch.float32)
    in_place = aten._log_softmax_backward_data.out(grad, lsm, 1, torch.float32, out=grad)
    assert in_place.data_ptr() == grad.data_ptr() and torch.equal(in_place, expected)


class _Scan(nn.Module):
    """A selective scan's loop (transformers' Mamba with ``use_associative_scan=False``): each
    step reads a slice of two tensors the step made, so autograd's engine sums a whole-tensor
    gradient of each, per step."""

    def __init__(self, steps=4):
        super().__init__()
        self.a = nn.Parameter(torch.rand(4, 128, steps, 8) * 0.5)
        self.b = nn.Parameter(torch.randn(4, 128, steps, 8))
        self.steps = steps

    def forward(self, c):
        a, b, state, outs = self.a * 1.0, self.b * 1.0, torch.zeros(4, 128, 8), []
        for i in range(self.steps):
            state = a[:, :, i] * state + b[:, :, i]
            outs.append(torch.matmul(state, c[:, i, :].unsqueeze(-1))[:, :, 0])
        return torch.stack(outs, -1).sum()


def test_gradient_sums_are_written_in_place_as_eager_writes_them():
    """Eager's engine writes each sum of two gradients over the one it holds (`fxopt.passes.
    accumulate`): the eager peak fxopt predicts is the measured one (one whole gradient above it
    before: 512.5 KiB against 448.5), fxopt's step at 1.0 writes the sums in place too and
    measures at or below eager with nothing recomputed, and the loss and every gradient are
    bit-equal to eager's."""
    torch.manual_seed(0)
    model, c = _Scan(), torch.randn(4, 4, 8)
    eager = copy.deepcopy(model)
    eager_peak = measured_peak(eager, (c,))
    optimized = fxopt.optimize(copy.deepcopy(model), 1.0, example_inputs=(c,))
    plan = optimized.plan
    assert plan.eager_peak_bytes == eager_peak, (plan.eager_peak_bytes, eager_peak)
    assert sum(n.name.startswith("add_out") for n in plan.graph.nodes) >= 2 * (model.steps - 1)
    assert plan.recompute_flops == 0
    assert measured_peak(optimized, (c,)) <= eager_peak
    eager.zero_grad(set_to_none=True)
    optimized.zero_grad(set_to_none=True)
    assert torch.equal(step(eager, (c,)), step(optimized, (c,)))
    for p_e, p_o in zip(eager.parameters(), optimized.parameters(), strict=True):
        assert torch.equal(p_e.grad, p_o.grad)


def test_a_gradient_sum_written_in_place_takes_its_operands_fake_value(monkeypatch):
    """Counted work of the rewrite (`fxopt.passes.accumulate`): ``add.out`` is not run again under
    fake tensors (it returns ``out``: the sum's fake value is its operand's, of its layout); only
    the views reading a sum are made again, once each, so that they alias the operand."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fxopt.planner as planner
    from fxopt.fxgraph import aliases_input

    ran: dict = {}
    rewritten = []
    dispatch, rewrite = FakeTensorMode.dispatch, planner.sum_gradients_in_place

    def counted(self, func, types, args=(), kwargs={}):
        ran[func] = ran.get(func, 0) + 1
        return dispatch(self, func, types, args, kwargs)

    def counted_rewrite(gm):
        monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
        try:
            rewritten.append((gm, rewrite(gm)))
        finally:
            monkeypatch.setattr(FakeTensorMode, "dispatch", dispatch)
        return rewritten[-1][1]

    monkeypatch.setattr(planner, "sum_gradients_in_place", counted_rewrite)
    torch.manual_seed(0)
    fxopt.plan(_Scan(), 1.0, (torch.randn(4, 4, 8),))
    gm, count = rewritten[0]
    sums = list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.out))
    assert count == len(sums) >= 6
    assert torch.ops.aten.add.out not in ran
    for node in sums:
        assert node.meta["val"] is node.kwargs["out"].meta["val"]
    views, stack = 0, [u for n in sums for u in n.users]
    while stack:
        node = stack.pop()
        if aliases_input(node.target):
            views += 1
            stack.extend(node.users)
    assert sum(ran.values()) == views


def test_a_gradient_sum_is_written_over_an_operand_nothing_else_reads():
    """`fxopt.fxgraph.accumulates_into`: the first operand made in the backward that only the sum
    reads (through views too); an operand read again, a sum not marked as autograd's, or one of
    another layout is left as it is."""
    from fxopt.fxgraph import _GRADIENT_SUM, accumulates_into

    def sum_of(second_reader: bool, marked: bool = True, view_first: bool = False):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(4, 8)
        made = []
        for name in ("ga", "gb"):
            node = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
            node.meta.update(val=torch.empty(4, 8), partitioner_tag="is_backward")
            made.append(node)
        first = made[0]
        if view_first:
            first = g.call_function(torch.ops.aten.view.default, (made[0], [4, 8]))
            first.meta.update(val=made[0].meta["val"].view(4, 8), partitioner_tag="is_backward")
        total = g.call_function(torch.ops.aten.add.Tensor, (first, made[1]))
        total.meta.update(val=torch.empty(4, 8), partitioner_tag="is_backward",
                          stack_trace=f"{_GRADIENT_SUM}\n" if marked else "")
        if second_reader:
            g.output((total, first))
        else:
            g.output(total)
        return total, first, made[1]

    total, first, _ = sum_of(second_reader=False)
    assert accumulates_into(total) is first
    total, first, _ = sum_of(second_reader=False, view_first=True)
    assert accumulates_into(total) is first
    total, _, second = sum_of(second_reader=True)
    assert accumulates_into(total) is second
    total, _, _ = sum_of(second_reader=False, marked=False)
    assert accumulates_into(total) is None
