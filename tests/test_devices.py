"""Device profiles (`fxopt.devices`, ``fxopt/profiles/*.json``) and ``device=``: a step planned on
fake tensors for the host profile is the step planned on its real tensors (the same predicted
peak to the byte, the same decisions), for every model of the test zoo and for a model built
under ``torch.device("meta")``. A CUDA profile is planned on fake tensors of this host, its memory
semantics applied: every storage rounded to the caching allocator's blocks, the cuBLAS workspace
resident, the scratch of ops that cannot run here a stated formula (nothing measured here), its
rates in the cost model and its host link for OFFLOAD."""

import json

import pytest
import torch

import fxopt
from fxopt import devices
from fxopt.analysis import UNREAD_RESIDENT, CostModel
from fxopt.models import ZOO, gpt2

TIME_LIMIT = 60


def test_the_shipped_profiles_load_with_their_sources_and_no_zero_scratch():
    assert {"cpu", "H100-80GB", "A100-40GB", "H200"} <= set(devices.names())
    for name in devices.names():
        profile = devices.load(name)
        data = json.loads((devices.SHIPPED / f"{name}.json").read_text())
        assert profile.name == name and profile.kind in devices.KINDS
        assert all(data[k] for k in ("memory_source", "cublas_workspace_source", "flops_source"))
        assert data["allocator"]["source"] and data["scratch"]["source"]
        assert profile.scratch_measured or profile.scratch_factor > 0
        if profile.kind == "cuda":
            assert profile.round_bytes == 512 and profile.cublas_workspace_bytes > 0 and profile.memory_bytes > 0
            assert profile.rounded(1) == 512 and profile.rounded(1024) == 1024 and profile.rounded(0) == 0
            assert profile.flops_per_second["bfloat16"] > profile.flops_per_second["float32"] > 0
            assert profile.host_link_bytes_per_second > 0 and profile.interconnect_bytes_per_second > 0
    assert devices.load("H100-80GB").cublas_workspace_bytes == 32 << 20  # compute capability 9
    assert devices.load("A100-40GB").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_a_user_profile_is_a_file_and_a_bad_one_is_refused(tmp_path):
    data = json.loads((devices.SHIPPED / "H100-80GB.json").read_text())
    data.update(name="my-gpu", memory_bytes=24 << 30)
    path = tmp_path / "my-gpu.json"
    path.write_text(json.dumps(data))
    assert devices.load(str(path)).name == "my-gpu"
    assert fxopt.Options(budget=0.5, device=path).device.memory_bytes == 24 << 30
    data["scratch"]["default_factor"] = 0
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="never assumed zero"):
        devices.load(str(zero))
    with pytest.raises(ValueError, match="shipped ones are .*H100-80GB"):
        fxopt.Options(budget=0.5, device="H100")
    with pytest.raises(ValueError, match="missing or bad field"):
        (tmp_path / "empty.json").write_text("{}")
        devices.load(str(tmp_path / "empty.json"))


def same_prediction(fake: fxopt.Plan, real: fxopt.Plan) -> None:
    assert fake.peak_bytes == real.peak_bytes
    assert fake.eager_peak_bytes == real.eager_peak_bytes and fake.budget_bytes == real.budget_bytes
    assert (fake.saved, fake.recomputed, fake.compressed) == (real.saved, real.recomputed, real.compressed)
    assert fake.recompute_flops == real.recompute_flops and fake.fingerprint == real.fingerprint


def plan_or_refusal(model, inputs, **options):
    try:
        return fxopt.plan(model, 0.5, inputs, time_limit=TIME_LIMIT, **options)
    except fxopt.InfeasibleBudgetError as err:
        return err


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_fake_tensor_plan_is_the_real_tensor_plan(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    real = plan_or_refusal(model, inputs)
    torch._dynamo.reset()
    fake = plan_or_refusal(model, inputs, device="cpu")
    if isinstance(real, fxopt.InfeasibleBudgetError):  # (the same refusal: budget and smallest budget)
        assert isinstance(fake, fxopt.InfeasibleBudgetError)
        assert (fake.budget, fake.min_budget, fake.lower_bound) == (real.budget, real.min_budget, real.lower_bound)
    else:
        same_prediction(fake, real)
    assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())  # (the model is untouched)


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_is_planned_as_the_real_one():
    """Tied weights stay tied in the fake copy (``to_empty`` would untie them)."""
    shape = dict(layers=2, dim=64, heads=4, seq=64, batch=4, vocab=512)
    torch.manual_seed(0)
    model, inputs = gpt2(**shape)
    real = fxopt.plan(model, 0.5, inputs, time_limit=TIME_LIMIT)
    with torch.device("meta"):
        on_meta, meta_inputs = gpt2(**shape)
    torch._dynamo.reset()
    planned = fxopt.plan(on_meta, 0.5, meta_inputs, time_limit=TIME_LIMIT, device="cpu")
    same_prediction(planned, real)
    with pytest.raises(fxopt.CaptureError, match="device='cpu'"):  # without device=: refused, saying how
        fxopt.plan(on_meta, 0.5, meta_inputs)


def test_device_is_refused_where_the_step_runs():
    model, inputs = ZOO["inplace_net"]()
    with pytest.raises(fxopt.CaptureError, match="give it to fxopt.plan"):
        fxopt.optimize(model, 0.5, example_inputs=inputs, device="cpu")


def test_a_storage_of_one_byte_is_held_as_a_512_byte_block():
    """`SymbolicGraph.round_bytes`, as the analysis sets it from the profile: every storage and
    every encoding of one rounded up; a view (which owns nothing) and an empty value stay 0."""
    from fxopt.analysis.costs import CostModel as Costs
    from fxopt.analysis.symbolic import NodeSizes, Ranges, SymbolicGraph, symbol
    from fxopt.solvers.graph import Graph, Node

    batch = symbol("batch")
    nodes = (Node("x", "input"), Node("y", "forward", (0,), codec="bits"), Node("v", "forward", (1,), storage=1),
             Node("e", "forward", (0,)))
    sizes = (NodeSizes(bytes=1), NodeSizes(bytes=1000 * batch, compressed_bytes=125 * batch), NodeSizes(), NodeSizes())
    for block, expected in ((1, [1, 3000, 375, 0, 0]), (512, [512, 3072, 512, 0, 0])):
        graph = SymbolicGraph(Graph(nodes), sizes, Ranges({"batch": (1, 8)}), {"batch": 3}, Costs(),
                              round_bytes=block).at({"batch": 3})
        x, y, v, e = graph.nodes
        assert [x.bytes, y.bytes, y.compressed_bytes, v.bytes, e.bytes] == expected


class OneByOne(torch.nn.Module):
    """Tensors of 4 bytes: every one the CUDA caching allocator holds as a 512-byte block; and a
    reduction (``sum``), an op not known to allocate only its output on CUDA."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, 1))

    def forward(self, x):
        return (x @ self.w).relu().sum()


def test_a_cuda_profile_counts_each_storage_in_512_byte_blocks_and_the_cublas_workspace(monkeypatch):
    from fxopt.analysis import scratch

    def no_measuring(*args):
        raise AssertionError("an op was measured on the host for a CUDA profile")

    monkeypatch.setattr(scratch, "_measure", no_measuring)
    h100 = devices.load("H100-80GB")
    plan = fxopt.plan(OneByOne(), 1.0, (torch.ones(1, 1),), device=h100, time_limit=TIME_LIMIT)
    nodes = {n.name: n for n in plan.graph.nodes}
    owners = [n for n in plan.graph.nodes if n.storage is None and n.bytes > 0]
    assert owners and all(n.bytes % 512 == 0 for n in owners)
    assert nodes["primals_1"].bytes == 512  # the 4-byte weight
    assert nodes[UNREAD_RESIDENT].bytes == 32 << 20  # the workspace, held through the step
    assert plan.eager_peak_bytes >= (32 << 20) + 3 * 512  # weight, input, gradient at least
    sums = [n for n in plan.graph.nodes if n.name.startswith("sum")]
    relus = [n for n in plan.graph.nodes if n.name.startswith("relu")]
    assert sums and all(n.workspace >= 2 * (512 + 4) for n in sums)  # 2 x (input + output), never zero
    assert relus and all(n.workspace == 0 for n in relus)  # pointwise: its output only
    assert "planned for H100-80GB" in plan.summary() and "formula bound" in plan.summary()
    assert plan.graph.transfers.d2h_bytes_per_s == h100.host_link_bytes_per_second  # its link, not measured


@pytest.mark.parametrize("name", ["inplace_net", "transformer_block"])
def test_the_h100_plan_is_the_host_plan_rounded_with_the_workspace(name):
    """The same capture counted for the H100: each value's bytes the host profile's rounded up to
    512, one more resident value (the cuBLAS workspace); so the eager peak and the smallest budget
    are at least the host's plus the workspace."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    host = fxopt.plan(model, "min", inputs, device="cpu", time_limit=TIME_LIMIT, offload=False, compress=False)
    torch._dynamo.reset()
    h100 = fxopt.plan(model, "min", inputs, device="H100-80GB", time_limit=TIME_LIMIT, offload=False, compress=False)
    workspace = devices.load("H100-80GB").cublas_workspace_bytes
    by_name = {n.name: n for n in h100.graph.nodes}
    for n in host.graph.nodes:
        if n.storage is None and n.name != UNREAD_RESIDENT:
            assert by_name[n.name].bytes == devices.load("H100-80GB").rounded(n.bytes), n.name
    assert by_name[UNREAD_RESIDENT].bytes >= workspace
    assert h100.eager_peak_bytes >= host.eager_peak_bytes + workspace
    assert h100.budget_bytes >= host.budget_bytes + workspace


def test_a_cuda_profile_prices_ops_at_its_rates():
    from fxopt.plan_ahead import for_profile

    h100 = devices.load("H100-80GB")
    model = torch.nn.Linear(4, 4)
    options = for_profile(fxopt.Options(budget=0.5, device=h100), model)
    assert options.device is None and options.planned_for is h100
    assert options.cost_model.flops_per_second == h100.flops_per_second["float32"]
    assert options.cost_model.bytes_per_second == h100.memory_bandwidth_bytes_per_second
    bf16 = for_profile(fxopt.Options(budget=0.5, device=h100), model.to(torch.bfloat16))
    assert bf16.cost_model.flops_per_second == h100.flops_per_second["bfloat16"]
    given = CostModel(flops_per_second=1.0)
    assert for_profile(fxopt.Options(budget=0.5, device=h100, cost_model=given), model).cost_model == given
    host = for_profile(fxopt.Options(budget=0.5, device="cpu"), model)  # (the host's: as without device=)
    assert host.cost_model == CostModel()


def test_a_cuda_profile_claiming_measured_scratch_is_refused(tmp_path):
    data = json.loads((devices.SHIPPED / "H100-80GB.json").read_text())
    data["scratch"]["measured"] = True
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    model, inputs = ZOO["inplace_net"]()
    with pytest.raises(fxopt.CaptureError, match="scratch.measured to false"):
        fxopt.plan(model, 0.5, inputs, device=path)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_plans_for_an_h100(name):
    """Convolutions, dropout, in-place ops, tied weights, several outputs: each step plans for the
    H100 at its smallest budget, every storage in 512-byte blocks, the workspace held."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    plan = fxopt.plan(model, "min", inputs, device="H100-80GB", time_limit=TIME_LIMIT)
    assert plan.peak_bytes <= plan.budget_bytes <= plan.eager_peak_bytes
    assert all(n.bytes % 512 == 0 for n in plan.graph.nodes if n.storage is None)
    assert plan.graph.nodes[-1].name == UNREAD_RESIDENT and plan.graph.nodes[-1].bytes >= 32 << 20
    assert plan.planned_for.startswith("planned for H100-80GB") and "formula bound" in plan.planned_for


def test_eager_dropout_keeps_a_bool_mask_on_cuda_and_a_float_one_on_the_host():
    """``at::dropout`` runs the fused ``native_dropout`` (a bool mask) on CUDA only; on the host
    eager keeps a noise tensor of the input's dtype (`Node.eager_bytes`). The fake tensors are the
    host's for both profiles: the mask's eager bytes follow the profile."""
    torch.manual_seed(0)
    model, inputs = ZOO["transformer_block"]()
    host = fxopt.plan(model, 1.0, inputs, device="cpu", time_limit=TIME_LIMIT, compress=False)
    torch._dynamo.reset()
    h100 = fxopt.plan(model, 1.0, inputs, device="H100-80GB", time_limit=TIME_LIMIT, compress=False, offload=False)
    host_masks = {n.name: n.eager_bytes for n in host.graph.nodes if n.eager_bytes is not None}
    assert host_masks  # (the block has dropout)
    by_name = {n.name: n for n in h100.graph.nodes}
    assert all(by_name[name].eager_bytes is None for name in host_masks)
