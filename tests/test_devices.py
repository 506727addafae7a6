"""Device profiles (`fxopt.devices`, ``fxopt/profiles/*.json``) and ``device=``: a step planned on
fake tensors for the host profile is the step planned on its real tensors (the same predicted
peak to the byte, the same decisions), for every model of the test zoo and for a model built
under ``torch.device("meta")``; a CUDA profile is refused until its memory semantics apply."""

import json

import pytest
import torch

import fxopt
from fxopt import devices
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


def test_a_cuda_profile_is_refused_until_its_memory_semantics_apply():
    model, inputs = ZOO["inplace_net"]()
    with pytest.raises(fxopt.CaptureError, match="H100-80GB.*not supported yet"):
        fxopt.plan(model, 0.5, inputs, device="H100-80GB")
