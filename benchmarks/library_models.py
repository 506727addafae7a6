"""Models from libraries nobody here wrote, beyond `benchmarks.hf_zoo`: `diffusers` and torchtitan,
built from small configs (random weights, nothing downloaded), each wrapped so that
``model(*inputs)`` returns the scalar loss a training loop would take.

    from benchmarks.library_models import LIBRARY_MODELS
    model, inputs = LIBRARY_MODELS["unet2d_condition"]()
    model(*inputs).backward()

Installing them here: ``pip install diffusers`` (no torchvision needed); torchtitan 0.3.0 with
``pip install --no-deps torchtitan==0.3.0 spmd_types tyro einops docstring_parser``. Its MoE
kernels import triton, which a CPU machine lacks: `_torchtitan` puts a stub of that module in
their place, which dense models never call. FlexAttention has no CPU backward, so the attention
is torchtitan's ``ScaledDotProductAttention``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


class SampleLoss(nn.Module):
    """A diffusers model called on ``inputs[:-1]``, its ``.sample`` regressed onto ``inputs[-1]``
    (mean squared error, as a denoising objective takes it)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *args, target = inputs
        return F.mse_loss(self.model(**dict(zip(self.names, args))).sample, target)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def unet2d_condition() -> Built:
    """diffusers' UNet2DConditionModel (Stable Diffusion's), cross-attention on text states."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                 attention_head_dim=8, norm_num_groups=8)
    inputs = (_randn(4, 4, 16, 16), torch.tensor([10, 20, 30, 40]), _randn(4, 8, 32, seed=1), _randn(4, 4, 16, 16, seed=2))
    return SampleLoss(model, ("sample", "timestep", "encoder_hidden_states")).train(), inputs


def autoencoder_kl() -> Built:
    """diffusers' AutoencoderKL (the VAE), reconstructing its input."""
    from diffusers import AutoencoderKL

    model = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64), latent_channels=4,
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          norm_num_groups=8, sample_size=32)
    image = _randn(4, 3, 32, 32)
    return SampleLoss(model, ("sample",)).train(), (image, image.clone())


def dit() -> Built:
    """diffusers' DiTTransformer2DModel (class-conditional diffusion transformer)."""
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                                  num_layers=2, sample_size=16, patch_size=2, num_embeds_ada_norm=10)
    inputs = (_randn(4, 4, 16, 16), torch.tensor([10, 20, 30, 40]), torch.tensor([1, 2, 3, 4]), _randn(4, 4, 16, 16, seed=2))
    return SampleLoss(model, ("hidden_states", "timestep", "class_labels")).train(), inputs


def sd3_transformer() -> Built:
    """diffusers' SD3Transformer2DModel (Stable Diffusion 3's joint-attention MMDiT)."""
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                  attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                  caption_projection_dim=64, pooled_projection_dim=16, pos_embed_max_size=16)
    inputs = (_randn(4, 4, 16, 16), _randn(4, 8, 32, seed=1), _randn(4, 16, seed=3), torch.tensor([10, 20, 30, 40]),
              _randn(4, 4, 16, 16, seed=2))
    return SampleLoss(model, ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")).train(), inputs


class TokenLoss(nn.Module):
    """A torchtitan model on tokens, cross-entropy against the next tokens (in float32)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(tokens).flatten(0, -2).float(), labels.flatten())


def _torchtitan(family: str, layers: int | None = None) -> Callable[[], Built]:
    def build() -> Built:
        stub = types.ModuleType("torchtitan.distributed.minimal_async_ep")  # triton-only MoE kernels
        for name in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config",
                     "MinimalAsyncEPDispatchMetadata"):
            setattr(stub, name, None)
        sys.modules.setdefault("torchtitan.distributed.minimal_async_ep", stub)
        import importlib

        from torchtitan.models.common.attention import ScaledDotProductAttention

        configs = getattr(importlib.import_module(f"torchtitan.models.{family}"), f"{family}_configs")
        config = configs["debugmodel"](attn_backend="flex")
        if layers is not None:
            config.layers = config.layers[:layers]
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention: no CPU backward
            layer.attention.rope.max_seq_len = 256
        torch.manual_seed(0)
        model = config.build()
        model.init_states(buffer_device=torch.device("cpu"))
        tokens = torch.randint(0, 2048, (2, 257), generator=torch.Generator().manual_seed(0))
        return TokenLoss(model).train(), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return build


LIBRARY_MODELS: dict[str, Callable[[], Built]] = {
    "unet2d_condition": unet2d_condition,
    "autoencoder_kl": autoencoder_kl,
    "dit": dit,
    "sd3_transformer": sd3_transformer,
    "torchtitan_llama3": _torchtitan("llama3"),
    "torchtitan_qwen3": _torchtitan("qwen3", layers=2),
}
# The library each model needs (a missing one makes the model a row that says so).
LIBRARY = {name: "torchtitan" if name.startswith("torchtitan") else "diffusers" for name in LIBRARY_MODELS}
