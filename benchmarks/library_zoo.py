"""Models of other libraries with their own activation checkpointing: small configs, random
weights, no downloads. Importing this module registers them in the one model zoo,
`fxopt.models.MODELS`, in the set ``"library"``, as ``"lib-<name>"`` (fxopt itself does not import
diffusers or timm); each entry's ``checkpointing(model, on)`` switches the library's own
checkpointing of a model it built, and ``model(*inputs)`` is the scalar loss of a training step:

- diffusers (``enable_gradient_checkpointing()``: `torch.utils.checkpoint` around each ResNet,
  transformer and encoder/decoder block): ``lib-unet`` (`UNet2DConditionModel` with
  cross-attention), ``lib-vae`` (`AutoencoderKL`), ``lib-dit`` (`DiTTransformer2DModel`),
  ``lib-sd3`` (`SD3Transformer2DModel`); the loss is the mean squared error against a fixed target;
- timm (``set_grad_checkpointing(True)``, per block or stage): ``lib-timm-vit``,
  ``lib-timm-convnext``, where timm imports (it needs torchvision: a venv with torch 2.14.1 and
  torchvision 0.29.1);
- torchtitan (``FullAC``: `torch.distributed`'s ``checkpoint_wrapper`` around each transformer
  block, what torchtitan's trainer applies with ``activation_checkpoint=FullAC.Config()``):
  ``lib-titan-llama3`` and ``lib-titan-qwen3`` (the debug models, qwen3 cut to 2 layers), the
  loss the cross-entropy against the next tokens. torchtitan 0.3.0 installs with ``pip install
  --no-deps torchtitan==0.3.0 spmd_types tyro einops docstring_parser``; its MoE kernels import
  triton, which a CPU machine lacks, so a stub of that module stands in for them (dense models
  never call it); FlexAttention has no CPU backward, so the attention is torchtitan's
  ``ScaledDotProductAttention``;
- transformers (``gradient_checkpointing_enable()``, per decoder or encoder layer): the ``hf-<name>``
  entries of `benchmarks.hf_zoo` (imported here), whose switch is ``hf_zoo.hf_checkpointing``.

Sizes: ``"test"`` (a step in about a second on a 2-core CPU, for the suite) and ``"bench"``
(what `benchmarks.library_checkpointing` runs).

    import benchmarks.library_zoo
    from fxopt.models import MODELS
    entry = MODELS["lib-unet"]
    model, inputs = entry("test")
    entry.checkpointing(model, True)
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import benchmarks.hf_zoo  # noqa: F401 - the transformers models this zoo's benchmark runs
from fxopt.models import MODELS, Workload, register

SIZES = ("test", "bench")


class MSELoss(nn.Module):
    """``inner(*inputs[:-1], **kwargs)``'s output (``.sample``) against ``inputs[-1]``; the
    library model is ``self.inner``. ``names``: the keyword each input but the first and the
    target is passed as."""

    def __init__(self, inner: nn.Module, names: tuple[str, ...] = ()):
        super().__init__()
        self.inner = inner
        self.names = names

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        *args, target = rest
        out = self.inner(x, **dict(zip(self.names, args)))
        return F.mse_loss(out.sample if hasattr(out, "sample") else out, target)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- diffusers
def _diffusers_switch(model: MSELoss, on: bool) -> None:
    inner = model.inner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (inner.enable_gradient_checkpointing if on else inner.disable_gradient_checkpointing)()


def unet(size: str):
    from diffusers import UNet2DConditionModel

    batch, pixels = (4, 16) if size == "test" else (3, 32)
    inner = UNet2DConditionModel(
        sample_size=pixels, in_channels=4, out_channels=4, layers_per_block=1 if size == "test" else 2,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=8)
    inputs = (_randn(batch, 4, pixels, pixels, seed=0), torch.full((batch,), 10), _randn(batch, 8, 32, seed=1),
              _randn(batch, 4, pixels, pixels, seed=2))
    return MSELoss(inner, ("timestep", "encoder_hidden_states")), inputs


def vae(size: str):
    from diffusers import AutoencoderKL

    batch, pixels = (2, 16) if size == "test" else (2, 48)  # (batch 1 fails in torch.compile too)
    inner = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=pixels)
    x = _randn(batch, 3, pixels, pixels, seed=0)
    return MSELoss(inner), (x, x)


def dit(size: str):
    from diffusers import DiTTransformer2DModel

    batch, pixels, layers = (2, 8, 2) if size == "test" else (2, 32, 4)
    inner = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16 if size == "test" else 32, in_channels=4, out_channels=4,
        num_layers=layers, sample_size=pixels, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8)
    inputs = (_randn(batch, 4, pixels, pixels, seed=0), torch.full((batch,), 10), torch.arange(batch) % 10,
              _randn(batch, 4, pixels, pixels, seed=2))
    return MSELoss(inner, ("timestep", "class_labels")), inputs


def sd3(size: str):
    from diffusers import SD3Transformer2DModel

    batch, pixels, layers, heads = (2, 8, 2, 2) if size == "test" else (2, 32, 4, 4)
    inner = SD3Transformer2DModel(
        sample_size=pixels, patch_size=2, in_channels=4, out_channels=4, num_layers=layers, attention_head_dim=16,
        num_attention_heads=heads, joint_attention_dim=32, caption_projection_dim=16 * heads,
        pooled_projection_dim=32, pos_embed_max_size=pixels)
    inputs = (_randn(batch, 4, pixels, pixels, seed=0), _randn(batch, 8, 32, seed=1), _randn(batch, 32, seed=3),
              torch.full((batch,), 10), _randn(batch, 4, pixels, pixels, seed=2))
    return MSELoss(inner, ("encoder_hidden_states", "pooled_projections", "timestep")), inputs


# ---------------------------------------------------------------- timm
class _TimmLoss(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.inner(pixels), labels)


def _timm(model_name: str, **config) -> Callable[[str], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build(size: str):
        import timm

        batch, pixels = (2, 32) if size == "test" else (8, 64)
        inner = timm.create_model(model_name, pretrained=False, num_classes=10, img_size=pixels, **config) \
            if "vit" in model_name else timm.create_model(model_name, pretrained=False, num_classes=10, **config)
        labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
        return _TimmLoss(inner), (_randn(batch, 3, pixels, pixels, seed=0), labels)

    return build


def _timm_switch(model: _TimmLoss, on: bool) -> None:
    model.inner.set_grad_checkpointing(on)


# ---------------------------------------------------------------- torchtitan
class _TokenLoss(nn.Module):
    """A torchtitan decoder on tokens, the cross-entropy against the next tokens (in float32)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.inner(tokens).flatten(0, -2).float(), labels.flatten())


def _titan_stub() -> None:
    """torchtitan's expert-parallel module imports triton kernels at import time; dense models
    never call them."""
    name = "torchtitan.distributed.minimal_async_ep"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        for attr in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config",
                     "MinimalAsyncEPDispatchMetadata"):
            setattr(stub, attr, None)
        sys.modules[name] = stub


def _titan(family: str, layers: int | None = None) -> Callable[[str], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build(size: str):
        _titan_stub()
        from torchtitan.models.common.attention import ScaledDotProductAttention

        batch, seq = (2, 32) if size == "test" else (2, 256)
        config = getattr(importlib.import_module(f"torchtitan.models.{family}"), f"{family}_configs")["debugmodel"](
            attn_backend="flex")
        if layers is not None:
            config.layers = config.layers[:layers]
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention: no CPU backward
            layer.attention.rope.max_seq_len = seq
        inner = config.build()
        inner.init_states(buffer_device=torch.device("cpu"))
        tokens = torch.randint(0, 2048, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        return _TokenLoss(inner), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    return build


def _titan_switch(model: _TokenLoss, on: bool) -> None:
    """torchtitan's FullAC on (each block in a ``CheckpointWrapper``) or off (the blocks unwrapped)."""
    layers = model.inner.get_submodule("layers")
    if on:
        from torchtitan.distributed.activation_checkpoint import FullAC

        FullAC.Config().build().apply(model.inner)
    else:
        for name, block in list(layers.named_children()):
            layers.register_module(name, getattr(block, "_checkpoint_wrapped_module", block))


def _library_build(name: str, build_fn: Callable[[str], tuple[nn.Module, tuple[torch.Tensor, ...]]],
                   description: str) -> Callable[[str], Workload]:
    """The zoo's build of one library model: ``size`` -> its `Workload`, the loss module in
    training mode, built under seed 0 (dropout 0: the configs' default)."""
    def build(size: str) -> Workload:
        torch.manual_seed(0)
        model, inputs = build_fn(size)
        return Workload(name, model.train(), tuple(inputs), [], description)
    return build


# name, source (library.class), builder, its checkpointing switch, description; registered in
# `fxopt.models.MODELS` as "lib-<name>"
for _name, _source, _build, _switch, _description in (
    ("unet", "diffusers.UNet2DConditionModel", unet, _diffusers_switch, "diffusers UNet with cross-attention, MSE loss"),
    ("vae", "diffusers.AutoencoderKL", vae, _diffusers_switch, "diffusers VAE reconstructing its input, MSE loss"),
    ("dit", "diffusers.DiTTransformer2DModel", dit, _diffusers_switch, "diffusers DiT, class-conditioned, MSE loss"),
    ("sd3", "diffusers.SD3Transformer2DModel", sd3, _diffusers_switch, "diffusers SD3 MMDiT, MSE loss"),
    ("timm-vit", "timm.vit_tiny_patch16_224", _timm("vit_tiny_patch16_224", patch_size=8, depth=4), _timm_switch,
     "timm ViT-tiny, patch 8, 4 blocks, cross-entropy"),
    ("timm-convnext", "timm.convnext_atto", _timm("convnext_atto"), _timm_switch, "timm ConvNeXt-atto, cross-entropy"),
    ("titan-llama3", "torchtitan.llama3", _titan("llama3"), _titan_switch,
     "torchtitan llama3 debug model, SDPA attention, next-token cross-entropy"),
    ("titan-qwen3", "torchtitan.qwen3", _titan("qwen3", layers=2), _titan_switch,
     "torchtitan qwen3 debug model cut to 2 layers, SDPA attention, next-token cross-entropy"),
):
    if f"lib-{_name}" not in MODELS:  # (registered once, however often this module is imported)
        register(f"lib-{_name}", _library_build(_name, _build, _description), SIZES, ("library",), _description,
                 source=_source, checkpointing=_switch)
