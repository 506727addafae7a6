"""Built-in models: the demo's default model and the test zoo, written the way people write models.

Each factory returns ``(model, example_inputs)``: ``model(*example_inputs)`` is one forward pass,
and `loss_of` turns whatever it returns into a scalar to call ``.backward()`` on. This is also the
contract of ``fxopt inspect path/to/file.py:factory``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def loss_of(output) -> torch.Tensor:
    """A scalar from any model output: the sum of every floating-point tensor in it."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point():
            return output.new_zeros((), dtype=torch.float32)
        return output if output.dim() == 0 else output.sum()
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        parts = [loss_of(o) for o in output]
        return torch.stack(parts).sum() if parts else torch.zeros(())
    return torch.zeros(())


# ---------------------------------------------------------------- residual MLP (the demo model)
class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.l1 = nn.Linear(width, width)
        self.l2 = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.l2(torch.relu(self.l1(x)))) + x


class ResidualMLP(nn.Module):
    """Returns the loss, ``output.sum()``."""

    def __init__(self, blocks: int = 8, width: int = 512):
        super().__init__()
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x).sum()


def residual_mlp(blocks: int = 8, width: int = 512, batch: int = 4096):
    """8 residual blocks relu(l2(relu(l1(x)))) + x, fp32, loss = output.sum()
    (`../shared/REFERENCE.md` §2)."""
    return ResidualMLP(blocks, width), (torch.randn(batch, width),)


# ---------------------------------------------------------------- CNN with BatchNorm
class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        )
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x, target):
        h = self.features(x).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), target)


def cnn_bn(batch: int = 8, size: int = 32, channels: int = 16):
    """Conv-BN-ReLU stack with max-pooling and a classifier; returns the loss."""
    return SmallCNN(channels), (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))


# ---------------------------------------------------------------- transformer block
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def transformer_block(batch: int = 4, seq: int = 64, dim: int = 64, heads: int = 4):
    """Pre-LN causal self-attention + GELU MLP with dropout."""
    return TransformerBlock(dim, heads), (torch.randn(batch, seq, dim),)


# ---------------------------------------------------------------- in-place ops
class InplaceNet(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x).relu_()
            x = (h * 0.5).add_(x)
        return x


def inplace_net(batch: int = 256, width: int = 128):
    """Linear layers with in-place relu_ and add_."""
    return InplaceNet(width), (torch.randn(batch, width),)


# ---------------------------------------------------------------- tied weights
class TiedLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        logits = self.head(self.hidden(self.embed(tokens)))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def tied_lm(batch: int = 8, seq: int = 64, vocab: int = 256):
    """Embedding and output layer sharing one weight; returns the loss."""
    return TiedLM(vocab), (torch.randint(0, vocab, (batch, seq)),)


# ---------------------------------------------------------------- several outputs in a dict
class MultiHead(nn.Module):
    def __init__(self, width: int = 128):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU())
        self.cls = nn.Linear(width, 10)
        self.reg = nn.Linear(width, 1)

    def forward(self, x):
        h = self.trunk(x)
        return {"logits": self.cls(h), "aux": (self.reg(h).squeeze(-1), h.mean()), "step": 3}


def multi_output(batch: int = 256, width: int = 128):
    """Returns a dict holding a tensor, a tuple of tensors and a Python int."""
    return MultiHead(width), (torch.randn(batch, width),)


# ---------------------------------------------------------------- GPT-2-style language model
class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.resid_drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.resid_drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    """GPT-2's architecture (pre-LN blocks, learned positions, tied input/output embeddings),
    returning the language-modelling loss."""

    def __init__(self, layers: int = 12, dim: int = 768, heads: int = 12, vocab: int = 50257,
                 max_seq: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt2(layers: int = 12, dim: int = 768, heads: int = 12, seq: int = 512, batch: int = 8, vocab: int = 50257):
    """GPT-2 small by default (124M parameters, no pretrained weights)."""
    idx = torch.randint(0, vocab, (batch, seq))
    return GPT(layers, dim, heads, vocab, max_seq=max(seq, 1024)), (idx, torch.roll(idx, -1, dims=1))


# ---------------------------------------------------------------- models to cut into pipeline stages
class GPTLM(nn.Module):
    """GPT-2's blocks with untied input and output embeddings, returning the logits (the loss is
    the pipeline schedule's ``loss_fn``, `lm_loss`): what `fxopt.pipeline` splits."""

    def __init__(self, layers: int = 8, dim: int = 64, heads: int = 4, vocab: int = 256, max_seq: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.h = nn.ModuleList(GPTBlock(dim, heads, 0.0) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, targets):
    """Next-token cross entropy, the mean over tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt2_lm(layers: int = 8, dim: int = 64, heads: int = 4, seq: int = 64, batch: int = 8, vocab: int = 256):
    """A GPT-2-style `GPTLM` and a batch of token ids; the targets are the ids shifted by one
    (``torch.roll(idx, -1, 1)``)."""
    return GPTLM(layers, dim, heads, vocab, max_seq=max(seq, 128)), (torch.randint(0, vocab, (batch, seq)),)


class SkipCNN(nn.Module):
    """Residual conv blocks (conv-ReLU-conv plus the block's input) at two resolutions, with a
    long skip from the stem to the head: a cut between blocks carries one tensor, a cut inside
    the long skip two. Returns the logits."""

    def __init__(self, channels: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        c = channels
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(_ConvBlock(c) for _ in range(blocks))
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.deep = nn.ModuleList(_ConvBlock(2 * c) for _ in range(blocks))
        self.up = nn.Conv2d(2 * c, c, 1)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        skip = x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        x = self.down(x)
        for block in self.deep:
            x = block(x)
        x = F.interpolate(self.up(x), scale_factor=2.0) + skip
        return self.head(x.mean(dim=(2, 3)))


class _ConvBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)


def skip_cnn(batch: int = 8, size: int = 32, channels: int = 16, blocks: int = 2):
    """A `SkipCNN` and a batch of images; targets are class ids (``torch.randint(0, 10, (batch,))``)."""
    return SkipCNN(channels, blocks), (torch.randn(batch, 3, size, size),)


# The test zoo: sizes where activations, not parameters, dominate the step, so budgets well
# below the eager peak are reachable, and each step takes milliseconds on a CPU.
ZOO = {
    "residual_mlp": lambda: residual_mlp(blocks=4, width=128, batch=2048),
    "cnn_bn": lambda: cnn_bn(batch=16, size=32, channels=16),
    "transformer_block": lambda: transformer_block(batch=8, seq=128, dim=64, heads=4),
    "inplace_net": lambda: inplace_net(batch=2048, width=128),
    "tied_lm": lambda: tied_lm(batch=16, seq=128, vocab=256),
    "multi_output": lambda: multi_output(batch=2048, width=128),
    "gpt2_tiny": lambda: gpt2(layers=2, dim=64, heads=4, seq=128, batch=8, vocab=512),
}
