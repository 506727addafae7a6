"""Model factories for ``fxopt inspect``: each returns ``(model, example_inputs)``.

    fxopt inspect examples/models.py:mlp --budget 50%
    fxopt inspect examples/models.py:transformer --budget 80% --run --plot transformer.png
    fxopt inspect examples/models.py:classifier --budget 95% --code

The contract: a factory takes no arguments and returns an ``nn.Module`` and the inputs of one
forward pass: a tuple or list of positional arguments, a dict of keyword arguments, or a single
tensor. fxopt plans ``model(*inputs)`` followed by the backward of the sum of its floating-point
outputs (the loss, if the model returns one), at exactly these shapes and dtypes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.models import gpt2, residual_mlp, transformer_block


def mlp():
    """6 residual blocks relu(l2(relu(l1(x)))) + x, width 64, batch 1024; returns the loss."""
    torch.manual_seed(0)
    return residual_mlp(blocks=6, width=64, batch=1024)


def transformer():
    """One pre-LN transformer block (attention + GELU MLP, dropout 0.1), batch 4, 128 tokens."""
    torch.manual_seed(0)
    return transformer_block(batch=4, seq=128, dim=64, heads=4)


def gpt2_tiny():
    """GPT-2's architecture at 2 layers of width 64 (vocabulary 512): a language model whose
    step is a few hundred aten ops. ``fxopt.models:gpt2`` is GPT-2 small itself (124M)."""
    torch.manual_seed(0)
    return gpt2(layers=2, dim=64, heads=4, seq=128, batch=8, vocab=512)


class Classifier(nn.Module):
    """A small convolutional classifier that takes keyword arguments and returns its loss."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, images, labels):
        h = F.max_pool2d(F.relu(self.conv1(images)), 2)
        h = F.relu(self.conv2(h)).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), labels)


def classifier():
    """Keyword inputs: ``model(images=..., labels=...)``."""
    torch.manual_seed(0)
    return Classifier(), {"images": torch.randn(16, 3, 32, 32), "labels": torch.randint(0, 10, (16,))}


def llama_on_meta(layers: int = 4, seq: int = 2048, batch: int = 1):
    """Llama-3-8B's widths (4096 wide, 14336 ffn, 32 heads, 8 key-value heads, 128256 tokens) at
    ``layers`` layers, in bfloat16, built under ``torch.device("meta")`` from a transformers
    ``LlamaConfig`` (no weights allocated): for ``fxopt fit ... --device H100-80GB``, which plans it
    on fake tensors. Needs transformers."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}
