"""Built-in models: the demo's default model and the one model zoo the tests and the benchmarks
build from, written the way people write models.

Each factory (`residual_mlp`, `gpt2`, ...) returns ``(model, example_inputs)``:
``model(*example_inputs)`` is one forward pass, and `loss_of` turns whatever it returns into a
scalar to call ``.backward()`` on. This is also the contract of ``fxopt inspect
path/to/file.py:factory``.

`MODELS` is the zoo: every model a test or a benchmark trains, by name, each at its sizes, with
the blocks per-block checkpointing wraps (`Workload`). `ZOO` is its test set::

    model, inputs = ZOO["gpt2_tiny"]()             # a test-zoo model at its one size
    w = MODELS["bert"].workload("tiny")            # a benchmark model: w.model, w.inputs, w.blocks
    model, inputs = MODELS["hf-llama"]("test")     # a transformers model (after importing benchmarks.hf_zoo)
    MODELS["hf-llama"].checkpointing(model, True)  # transformers' own checkpointing switched on
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

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


# ---------------------------------------------------------------- ResNet-like CNN with BatchNorm
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18's shape (stem, stages of basic blocks, global pooling), returning the loss."""

    def __init__(self, width: int = 16, blocks_per_stage: tuple[int, ...] = (2, 2, 2), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks_per_stage):
            cout = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, target):
        h = self.layers(self.stem(x)).mean(dim=(2, 3))
        return F.cross_entropy(self.fc(h), target)


# ---------------------------------------------------------------- U-Net-like CNN with skips
class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class UNet(nn.Module):
    """Encoder of double convolutions and max-pooling, decoder of transposed convolutions whose
    output is concatenated with the encoder's feature map of the same resolution (the skip
    connections keep every encoder output alive until the decoder reads it). Returns the
    per-pixel cross-entropy."""

    def __init__(self, width: int = 8, depth: int = 3, classes: int = 4):
        super().__init__()
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(3, chans[0])] + [DoubleConv(chans[i], chans[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth)))
        self.dec = nn.ModuleList(DoubleConv(2 * chans[i], chans[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x, target):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([skips.pop(), up(x)], dim=1))
        return F.cross_entropy(self.head(x), target)


# ---------------------------------------------------------------- BERT-style encoder
class BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + attn(x)); x = LN(x + FFN(x)), GELU, attention written
    out (scores and probabilities materialized, as in BERT's reference code) with an additive
    padding mask."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ffn_in, self.ffn_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x, mask_bias):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads) + mask_bias
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = self.ln1(x + self.out(y))
        return self.ln2(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class Bert(nn.Module):
    """BERT's encoder with its masked-LM head (tied decoder); returns the MLM loss over the
    positions whose label is not -100."""

    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 4, vocab: int = 1024, max_seq: int = 512):
        super().__init__()
        self.word = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.token_type = nn.Embedding(2, dim)
        self.ln = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(BertLayer(dim, heads) for _ in range(layers))
        self.transform = nn.Linear(dim, dim)
        self.transform_ln = nn.LayerNorm(dim)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.word.weight

    def forward(self, input_ids, attention_mask, labels):
        t = input_ids.size(1)
        pos = torch.arange(t, device=input_ids.device)
        x = self.ln(self.word(input_ids) + self.pos(pos) + self.token_type(torch.zeros_like(input_ids)))
        # 0 where attended, a large negative number on padding keys: broadcast over heads and queries
        mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask_bias)
        logits = self.decoder(self.transform_ln(F.gelu(self.transform(x))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def _init_like_gpt2(model: nn.Module, std: float = 0.02) -> nn.Module:
    """GPT-2's and BERT's initialization (normal, std 0.02; zero biases). With PyTorch's default
    N(0, 1) embeddings, the tied output layer's logits are huge, softmax gradients underflow to
    denormal floats and the CPU's matrix products on them run 50x slower."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return model


# ---------------------------------------------------------------- the zoo: one registry for tests and benchmarks
@dataclasses.dataclass
class Workload:
    """One model of the zoo at one size: the model, the positional inputs of ``model(*inputs)``,
    the blocks per-block ``torch.utils.checkpoint`` wraps (empty where no benchmark does) and what
    it is, in words."""

    name: str
    model: nn.Module
    inputs: tuple
    blocks: list[nn.Module]
    description: str

    def to(self, device: torch.device | str) -> Workload:
        self.model.to(device)
        self.inputs = tuple(x.to(device) for x in self.inputs)
        return self


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """An entry of `MODELS`. ``build(size, **options)`` makes its `Workload`; ``sizes`` are the
    sizes it has, the first its default; ``sets`` say who uses it: ``"test"`` (the test zoo,
    `ZOO`), ``"benchmark"`` (`benchmarks.pareto`'s models), ``"hf"`` (Hugging Face models, from
    ``benchmarks/hf_zoo.py``), ``"library"`` (diffusers and timm models, from
    ``benchmarks/library_zoo.py``). ``source``: the class it trains, where that is another
    library's. ``checkpointing``: where that library has its own activation checkpointing,
    ``checkpointing(model, on)`` switches it on or off in a model this entry built."""

    name: str
    build: Callable[..., Workload]
    sizes: tuple[str, ...]
    sets: frozenset[str]
    description: str
    source: str = ""
    checkpointing: Callable[[nn.Module, bool], None] | None = None

    def workload(self, size: str | None = None, **options: Any) -> Workload:
        size = self.sizes[0] if size is None else size
        if size not in self.sizes:
            raise ValueError(f"{self.name} has the sizes {', '.join(self.sizes)}, not {size!r}")
        return self.build(size, **options)

    def __call__(self, size: str | None = None, **options: Any) -> tuple[nn.Module, tuple]:
        """``(model, example_inputs)`` at ``size`` (by default the first of `sizes`)."""
        w = self.workload(size, **options)
        return w.model, w.inputs


MODELS: dict[str, ZooModel] = {}


def register(name: str, build: Callable[..., Workload], sizes: tuple[str, ...], sets: tuple[str, ...],
             description: str, source: str = "",
             checkpointing: Callable[[nn.Module, bool], None] | None = None) -> ZooModel:
    """Add an entry to `MODELS` (the Hugging Face, diffusers and timm models register from
    ``benchmarks/hf_zoo.py`` and ``benchmarks/library_zoo.py``, so that fxopt itself does not
    import those libraries)."""
    if name in MODELS:
        raise ValueError(f"the zoo already has a model named {name!r}")
    MODELS[name] = entry = ZooModel(name, build, tuple(sizes), frozenset(sets), description, source, checkpointing)
    return entry


def _fixed(name: str, factory: Callable[[], tuple[nn.Module, tuple]], description: str) -> Callable[[str], Workload]:
    """A test-zoo model's build: one size, no blocks."""
    def build(size: str) -> Workload:
        model, inputs = factory()
        return Workload(name, model, tuple(inputs), [], description)
    return build


# Benchmark sizes ("tiny", "quick", "full") are chosen so activations, not parameters, dominate the
# step (otherwise no method can lower the peak much) and so a step takes tens of milliseconds on a
# 2-core CPU at "quick" and a few hundred at "full". No benchmark model draws random numbers
# (dropout 0, as in most current LLM recipes): with dropout, Inductor and the decomposed
# aot_eager path draw masks from other RNG streams than eager, and the gradients-equal column
# would compare different masks, not different rewrites.
MLP_SIZES = {"test": dict(blocks=4, width=128, batch=2048),
             "tiny": dict(blocks=4, width=64, batch=256),
             "quick": dict(blocks=8, width=256, batch=512),
             "full": dict(blocks=8, width=512, batch=1024)}


def mlp_workload(size: str | dict) -> Workload:
    """``size``: a name from `MLP_SIZES` or a dict of `residual_mlp`'s arguments."""
    cfg = MLP_SIZES[size] if isinstance(size, str) else size
    model, inputs = residual_mlp(**cfg)
    return Workload("residual_mlp", model, tuple(inputs), list(model.blocks),
                    f"{cfg['blocks']} blocks relu(l2(relu(l1(x)))) + x, width {cfg['width']}, batch {cfg['batch']}; "
                    "loss = output.sum()")


RESNET_SIZES = {"tiny": dict(width=8, stages=(1, 1), batch=4, image=16),
                "quick": dict(width=16, stages=(2, 2, 2), batch=16, image=32),
                "full": dict(width=32, stages=(2, 2, 2), batch=8, image=64)}


def _resnet(size: str) -> Workload:
    cfg = RESNET_SIZES[size]
    model = ResNet(cfg["width"], cfg["stages"])
    b, s = cfg["batch"], cfg["image"]
    inputs = (torch.randn(b, 3, s, s), torch.randint(0, 10, (b,)))
    return Workload("resnet", model, inputs, [model.stem, *model.layers],
                    f"ResNet-style, basic blocks {cfg['stages']} per stage, width {cfg['width']}, BatchNorm, "
                    f"batch {b}, {s}x{s} images; loss = cross-entropy")


UNET_SIZES = {"tiny": dict(width=4, depth=2, batch=2, image=16),
              "quick": dict(width=8, depth=3, batch=4, image=64),
              "full": dict(width=16, depth=3, batch=4, image=128)}


def _unet(size: str) -> Workload:
    cfg = UNET_SIZES[size]
    model = UNet(cfg["width"], cfg["depth"])
    b, s = cfg["batch"], cfg["image"]
    inputs = (torch.randn(b, 3, s, s), torch.randint(0, 4, (b, s, s)))
    return Workload("unet", model, inputs, [*model.down, *model.dec],
                    f"U-Net-style, depth {cfg['depth']}, width {cfg['width']}, batch {b}, {s}x{s} images, "
                    "4 classes; loss = per-pixel cross-entropy")


GPT_SIZES = {"tiny": dict(layers=2, dim=32, heads=2, seq=32, batch=2, vocab=128),
             "quick": dict(layers=2, dim=128, heads=4, seq=128, batch=8, vocab=1024),
             "full": dict(layers=4, dim=256, heads=4, seq=256, batch=4, vocab=4096)}


def _gpt2(size: str) -> Workload:
    cfg = GPT_SIZES[size]
    model = _init_like_gpt2(GPT(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], max_seq=cfg["seq"], dropout=0.0))
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    return Workload("gpt2", model, (idx, torch.roll(idx, -1, dims=1)), list(model.h),
                    f"GPT-2 architecture (fxopt.models.GPT: pre-LN, SDPA causal attention, tied embeddings), "
                    f"{cfg['layers']} layers, width {cfg['dim']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
                    f"batch {cfg['batch']} x {cfg['seq']} tokens, dropout 0; loss = LM cross-entropy")


BERT_SIZES = {"tiny": dict(layers=2, dim=32, heads=2, seq=32, batch=2, vocab=128),
              "quick": dict(layers=2, dim=128, heads=4, seq=128, batch=8, vocab=1024),
              "full": dict(layers=4, dim=256, heads=4, seq=256, batch=2, vocab=4096)}


def _bert(size: str) -> Workload:
    cfg = BERT_SIZES[size]
    model = _init_like_gpt2(Bert(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], max_seq=cfg["seq"]))
    b, t = cfg["batch"], cfg["seq"]
    ids = torch.randint(0, cfg["vocab"], (b, t))
    lengths = torch.linspace(t // 2, t, b).long()  # each sequence padded to t from its own length
    attention_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    labels = torch.where((torch.rand(b, t) < 0.15) & attention_mask.bool(), ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one labelled token per sequence
    return Workload("bert", model, (ids, attention_mask, labels), list(model.layers),
                    f"BERT-style encoder (post-LN, GELU, explicit attention with a padding mask, tied MLM head), "
                    f"{cfg['layers']} layers, width {cfg['dim']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
                    f"batch {b} x {t} tokens (padded from {t // 2}..{t}), 15% of tokens labelled; "
                    "loss = masked-LM cross-entropy")


# The test zoo: sizes where activations, not parameters, dominate the step, so budgets well
# below the eager peak are reachable, and each step takes milliseconds on a CPU.
_TEST_ZOO = {
    "cnn_bn": (lambda: cnn_bn(batch=16, size=32, channels=16), "Conv-BN-ReLU stack, max-pooling, classifier"),
    "transformer_block": (lambda: transformer_block(batch=8, seq=128, dim=64, heads=4),
                          "pre-LN causal self-attention + GELU MLP, dropout 0.1"),
    "inplace_net": (lambda: inplace_net(batch=2048, width=128), "Linear layers with in-place relu_ and add_"),
    "tied_lm": (lambda: tied_lm(batch=16, seq=128, vocab=256), "embedding and output layer sharing one weight"),
    "multi_output": (lambda: multi_output(batch=2048, width=128), "a dict of a tensor, a tuple and an int"),
    "gpt2_tiny": (lambda: gpt2(layers=2, dim=64, heads=4, seq=128, batch=8, vocab=512),
                  "GPT-2 (fxopt.models.GPT), 2 layers, width 64, dropout 0.1"),
}
register("residual_mlp", mlp_workload, tuple(MLP_SIZES), ("test", "benchmark"),
         "residual blocks relu(l2(relu(l1(x)))) + x; loss = output.sum()")
for _name, (_factory, _description) in _TEST_ZOO.items():
    register(_name, _fixed(_name, _factory, _description), ("test",), ("test",), _description)
register("resnet", _resnet, tuple(RESNET_SIZES), ("benchmark",), "ResNet-style CNN with BatchNorm")
register("unet", _unet, tuple(UNET_SIZES), ("benchmark",), "U-Net-style CNN with skip connections")
register("gpt2", _gpt2, tuple(GPT_SIZES), ("benchmark",), "GPT-2 architecture, dropout 0")
register("bert", _bert, tuple(BERT_SIZES), ("benchmark",), "BERT-style encoder with a padding mask")


def zoo(name: str) -> dict[str, ZooModel]:
    """The entries of `MODELS` in the set ``name`` (``"test"``, ``"benchmark"``, ``"hf"``, ``"library"``)."""
    return {n: m for n, m in MODELS.items() if name in m.sets}


# The test zoo, by name: ``model, inputs = ZOO[name]()``.
ZOO: dict[str, ZooModel] = zoo("test")
