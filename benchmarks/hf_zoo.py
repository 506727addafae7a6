"""Hugging Face models as users train them: small configs, random weights, no downloads.

Importing this module registers them in the one model zoo, `fxopt.models.MODELS`, as
``"hf-<name>"`` (fxopt itself does not import transformers). Each builds a transformers model
from a config (no pretrained weights, nothing fetched) and its inputs, wrapped in `HFLoss` so
that ``model(*inputs)`` returns the scalar loss the HF model computes itself (``labels=`` →
``output.loss``), the way a training loop calls it.

    import benchmarks.hf_zoo
    from fxopt.models import MODELS
    model, inputs = MODELS["hf-bert"]("test")
    model(*inputs).backward()
    MODELS["hf-bert"].checkpointing(model, True)   # HF's own gradient checkpointing on

Sizes: ``"test"`` is tiny (each step well under a second on a 2-core CPU, for the test suite);
``"bench"`` is what `benchmarks.hf_models` runs (2 layers (T5, BART, Whisper: 1 + 1), hidden 128, sequences of 128 tokens
or 64-pixel images), chosen so activations, not parameters, dominate the step.

Every model has dropout 0 (including attention dropout) unless built with
``MODELS["hf-<name>"](size, dropout=p)``, so the step is deterministic and gradient parity against eager is
exact (with dropout, exact under the same seed: fxopt keeps eager's masks; ResNet and ConvNeXt
have no dropout to set); ``use_cache=False`` on decoders (training builds no KV
cache). Attention is HF's default implementation (``sdpa``). Decoders get a padding mask (the
last quarter of the second sequence padded, its labels -100), as batched training does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from fxopt.models import MODELS, Workload, register, zoo

SIZES = ("test", "bench")


class HFLoss(nn.Module):
    """An HF model called with keyword arguments ``names`` taken from the positional inputs,
    returning ``output.loss``. The HF model is ``self.hf``."""

    def __init__(self, hf: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.hf = hf
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.hf(**dict(zip(self.names, inputs))).loss


def _hf_build(name: str, build_fn: Callable[[str, float], tuple[nn.Module, dict[str, torch.Tensor]]],
              description: str) -> Callable[..., Workload]:
    """The zoo's build of one HF model: ``(size, dropout=0.0)`` -> its `Workload`, the model wrapped
    in `HFLoss` in training mode. ``dropout``: the probability of every dropout the config has
    (hidden, attention, activation)."""
    def build(size: str, dropout: float = 0.0) -> Workload:
        hf, named = build_fn(size, dropout)
        return Workload(name, HFLoss(hf, tuple(named)).train(), tuple(named.values()), [], description)
    return build


def hf_checkpointing(model: HFLoss, on: bool, checkpoint_kwargs: dict | None = None) -> None:
    """HF's own gradient checkpointing of ``model.hf`` switched on or off (every layer's forward
    under `torch.utils.checkpoint`, non-reentrant): ``activation_checkpointing_enable()``, the
    transformers 5 name of ``gradient_checkpointing_enable()`` (whose deprecation warning this
    silences), where the model has it. ``checkpoint_kwargs``: passed on to
    `torch.utils.checkpoint` (its ``context_fn``, say), as both names take them."""
    hf = model.hf
    if not hf.supports_gradient_checkpointing:
        raise ValueError(f"{type(hf).__name__} has no gradient checkpointing (supports_gradient_checkpointing "
                         "is False): benchmark it without the library's checkpointing")
    verb = "enable" if on else "disable"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        switch = getattr(hf, f"activation_checkpointing_{verb}", None) or getattr(hf, f"gradient_checkpointing_{verb}")
        if on and checkpoint_kwargs is not None:
            switch(checkpoint_kwargs)
        else:
            switch()


def _transformers():
    import transformers

    return transformers


# ---------------------------------------------------------------- sizes
# text: layers, hidden, heads, ffn, seq, batch, vocab
TEXT = {"test": dict(layers=2, hidden=32, heads=2, ffn=64, seq=16, batch=2, vocab=128),
        "bench": dict(layers=2, hidden=128, heads=4, ffn=512, seq=128, batch=4, vocab=1024)}
# images: batch, pixels, and for transformers layers/hidden/heads/ffn/patch
IMAGE = {"test": dict(layers=2, hidden=32, heads=2, ffn=64, image=32, patch=8, batch=2, widths=(8, 16), depths=(1, 1)),
         "bench": dict(layers=2, hidden=128, heads=4, ffn=512, image=64, patch=8, batch=8,
                       widths=(32, 64, 128, 256), depths=(1, 1, 2, 1))}
N_CLASSES = 10


def _text_inputs(c: dict, *, mask: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=g)
    out = {"input_ids": ids}
    if mask:
        attention = torch.ones_like(ids)
        attention[-1, -(c["seq"] // 4):] = 0  # right padding on the last sequence
        out["attention_mask"] = attention
    return out


def _seq2seq_labels(c: dict) -> torch.Tensor:
    """Target ids for an encoder-decoder: another draw, half the source length."""
    return _text_inputs(c, mask=False, seed=1)["input_ids"][:, : c["seq"] // 2].contiguous()


def _lm_labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = inputs["input_ids"].clone()
    if "attention_mask" in inputs:
        labels[inputs["attention_mask"] == 0] = -100
    return labels


def _pixels(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(c["batch"], 3, c["image"], c["image"], generator=g),
            "labels": torch.randint(0, N_CLASSES, (c["batch"],), generator=g)}


# ---------------------------------------------------------------- decoders
def gpt2(size: str, dropout: float = 0.0):
    t, c = _transformers(), TEXT[size]
    cfg = t.GPT2Config(n_layer=c["layers"], n_embd=c["hidden"], n_head=c["heads"], n_inner=c["ffn"],
                       n_positions=c["seq"], vocab_size=c["vocab"], resid_pdrop=dropout, embd_pdrop=dropout,
                       attn_pdrop=dropout, use_cache=False, bos_token_id=0, eos_token_id=0)
    inputs = _text_inputs(c)
    return t.GPT2LMHeadModel(cfg), {**inputs, "labels": _lm_labels(inputs)}


def _llama_like(config_cls: str, model_cls: str, size: str, dropout: float, **extra):
    t, c = _transformers(), TEXT[size]
    cfg = getattr(t, config_cls)(num_hidden_layers=c["layers"], hidden_size=c["hidden"],
                                 num_attention_heads=c["heads"], num_key_value_heads=max(1, c["heads"] // 2),
                                 intermediate_size=c["ffn"], vocab_size=c["vocab"],
                                 max_position_embeddings=c["seq"], attention_dropout=dropout, use_cache=False,
                                 **extra)
    inputs = _text_inputs(c)
    return getattr(t, model_cls)(cfg), {**inputs, "labels": _lm_labels(inputs)}


def llama(size: str, dropout: float = 0.0):
    return _llama_like("LlamaConfig", "LlamaForCausalLM", size, dropout)


def mistral(size: str, dropout: float = 0.0):
    return _llama_like("MistralConfig", "MistralForCausalLM", size, dropout, sliding_window=None)


def qwen2(size: str, dropout: float = 0.0):
    return _llama_like("Qwen2Config", "Qwen2ForCausalLM", size, dropout)


# ---------------------------------------------------------------- encoders
def bert(size: str, dropout: float = 0.0):
    t, c = _transformers(), TEXT[size]
    cfg = t.BertConfig(num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                       intermediate_size=c["ffn"], vocab_size=c["vocab"], max_position_embeddings=c["seq"],
                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    inputs = _text_inputs(c)
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, ::7] = inputs["input_ids"][:, ::7]  # masked-LM loss on one token in seven
    labels[inputs["attention_mask"] == 0] = -100
    return t.BertForMaskedLM(cfg), {**inputs, "labels": labels}


# ---------------------------------------------------------------- encoder-decoders
def _halves(c: dict, dropout: float) -> dict:
    """BART's and Whisper's config: half the layers in the encoder, half in the decoder."""
    half = c["layers"] // 2 or 1
    return dict(encoder_layers=half, decoder_layers=half, d_model=c["hidden"], encoder_attention_heads=c["heads"],
                decoder_attention_heads=c["heads"], encoder_ffn_dim=c["ffn"], decoder_ffn_dim=c["ffn"],
                vocab_size=c["vocab"], dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
                use_cache=False)


def _text_to_text(model: nn.Module, c: dict):
    return model, {**_text_inputs(c), "labels": _seq2seq_labels(c)}


def t5(size: str, dropout: float = 0.0):
    t, c = _transformers(), TEXT[size]
    cfg = t.T5Config(num_layers=c["layers"] // 2 or 1, num_decoder_layers=c["layers"] // 2 or 1, d_model=c["hidden"],
                     d_kv=c["hidden"] // c["heads"], num_heads=c["heads"], d_ff=c["ffn"], vocab_size=c["vocab"],
                     dropout_rate=dropout, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    return _text_to_text(t.T5ForConditionalGeneration(cfg), c)


def bart(size: str, dropout: float = 0.0):
    t, c = _transformers(), TEXT[size]
    cfg = t.BartConfig(**_halves(c, dropout), max_position_embeddings=c["seq"])
    return _text_to_text(t.BartForConditionalGeneration(cfg), c)


def whisper(size: str, dropout: float = 0.0):
    t, c = _transformers(), TEXT[size]
    frames = c["seq"]  # mel frames; the encoder's two convolutions halve them
    cfg = t.WhisperConfig(**_halves(c, dropout), num_mel_bins=16, max_source_positions=frames // 2,
                          max_target_positions=c["seq"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          decoder_start_token_id=1)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(c["batch"], 16, frames, generator=g)
    labels = torch.randint(3, c["vocab"], (c["batch"], c["seq"] // 4), generator=g)
    return t.WhisperForConditionalGeneration(cfg), {"input_features": features, "labels": labels}


# ---------------------------------------------------------------- vision
def _vit_config(config_cls: str, c: dict, dropout: float, **extra):
    return getattr(_transformers(), config_cls)(
        num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
        intermediate_size=c["ffn"], image_size=c["image"], patch_size=c["patch"], num_labels=N_CLASSES,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **extra)


def vit(size: str, dropout: float = 0.0):
    c = IMAGE[size]
    return _transformers().ViTForImageClassification(_vit_config("ViTConfig", c, dropout)), _pixels(c)


def deit(size: str, dropout: float = 0.0):
    c = IMAGE[size]
    return _transformers().DeiTForImageClassification(_vit_config("DeiTConfig", c, dropout)), _pixels(c)


def swin(size: str, dropout: float = 0.0):
    t, c = _transformers(), IMAGE[size]
    stages = 2 if size == "test" else 3
    cfg = t.SwinConfig(image_size=c["image"], patch_size=4, embed_dim=c["hidden"] // 4 if size == "bench" else 16,
                       depths=[2] * stages, num_heads=[2 * 2**i for i in range(stages)], window_size=4,
                       num_labels=N_CLASSES, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                       drop_path_rate=0.0)
    return t.SwinForImageClassification(cfg), _pixels(c)


def resnet(size: str, dropout: float = 0.0):  # no dropout in HF's ResNet
    t, c = _transformers(), IMAGE[size]
    cfg = t.ResNetConfig(embedding_size=c["widths"][0], hidden_sizes=list(c["widths"]), depths=list(c["depths"]),
                         layer_type="basic", num_labels=N_CLASSES)
    return t.ResNetForImageClassification(cfg), _pixels(c)


def convnext(size: str, dropout: float = 0.0):  # no dropout (drop_path stays 0: stochastic depth)
    t, c = _transformers(), IMAGE[size]
    cfg = t.ConvNextConfig(hidden_sizes=list(c["widths"]), depths=list(c["depths"]), num_labels=N_CLASSES,
                           drop_path_rate=0.0, num_stages=len(c["widths"]))
    return t.ConvNextForImageClassification(cfg), _pixels(c)


# name, transformers class, builder, description; registered in `fxopt.models.MODELS` as "hf-<name>"
for _name, _class, _build, _description in (
    ("gpt2", "GPT2LMHeadModel", gpt2, "GPT-2 LM, labels=input_ids, padding mask"),
    ("llama", "LlamaForCausalLM", llama, "Llama causal LM (GQA, RoPE, RMSNorm, SwiGLU), padding mask"),
    ("mistral", "MistralForCausalLM", mistral, "Mistral causal LM, padding mask"),
    ("qwen2", "Qwen2ForCausalLM", qwen2, "Qwen2 causal LM, padding mask"),
    ("bert", "BertForMaskedLM", bert, "BERT masked LM (loss on 1 token in 7), padding mask"),
    ("t5", "T5ForConditionalGeneration", t5, "T5 encoder-decoder, labels half the source length"),
    ("bart", "BartForConditionalGeneration", bart, "BART encoder-decoder, labels half the source length"),
    ("whisper", "WhisperForConditionalGeneration", whisper, "Whisper encoder-decoder on random mel features"),
    ("vit", "ViTForImageClassification", vit, "ViT image classifier"),
    ("deit", "DeiTForImageClassification", deit, "DeiT image classifier"),
    ("swin", "SwinForImageClassification", swin, "Swin image classifier (window attention)"),
    ("resnet", "ResNetForImageClassification", resnet, "ResNet (basic blocks, BatchNorm)"),
    ("convnext", "ConvNextForImageClassification", convnext, "ConvNeXt (depthwise conv, LayerNorm)"),
):
    if f"hf-{_name}" not in MODELS:  # (registered once, however often this module is imported)
        register(f"hf-{_name}", _hf_build(_name, _build, _description), SIZES, ("hf",), _description,
                 source=f"transformers.{_class}", checkpointing=hf_checkpointing)

# The Hugging Face models' short names (``"bert"`` for ``MODELS["hf-bert"]``), in the zoo's order.
HF_NAMES = tuple(n.removeprefix("hf-") for n in zoo("hf"))
