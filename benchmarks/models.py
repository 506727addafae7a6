"""The benchmark models: five architectures people train, each returning its scalar loss.

Every factory takes a size (``"tiny"``, ``"quick"``, ``"full"``) and returns a `Workload`: the
model, the positional inputs of ``model(*inputs)`` (a scalar loss; fxopt counts the incoming
gradient of any other output at full size), and the blocks that per-block
``torch.utils.checkpoint`` wraps. Sizes are chosen so activations, not parameters, dominate the
step (otherwise no method can lower the peak much) and so a step takes tens of milliseconds on
a 2-core CPU at ``"quick"`` and a few hundred at ``"full"``.

No model draws random numbers (dropout is 0, as in most current LLM recipes): with dropout,
Inductor and the decomposed aot_eager path draw masks from other RNG streams than eager, and the
gradients-equal column would compare different masks, not different rewrites.

    from benchmarks.models import MODELS
    w = MODELS["bert"]("tiny")
    w.model(*w.inputs).backward()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.models import GPT, residual_mlp

SIZES = ("tiny", "quick", "full")


@dataclasses.dataclass
class Workload:
    name: str
    model: nn.Module
    inputs: tuple
    blocks: list[nn.Module]  # what per-block torch.utils.checkpoint wraps
    description: str

    def to(self, device: torch.device | str) -> Workload:
        self.model.to(device)
        self.inputs = tuple(x.to(device) for x in self.inputs)
        return self


# ---------------------------------------------------------------- residual MLP (fxopt.models)
MLP_SIZES = {"tiny": dict(blocks=4, width=64, batch=256),
             "quick": dict(blocks=8, width=256, batch=512),
             "full": dict(blocks=8, width=512, batch=1024)}


def mlp(size: str | dict) -> Workload:
    """``size``: a name from `SIZES` or a dict of `fxopt.models.residual_mlp`'s arguments."""
    cfg = MLP_SIZES[size] if isinstance(size, str) else size
    model, inputs = residual_mlp(**cfg)
    return Workload("residual_mlp", model, tuple(inputs), list(model.blocks),
                    f"{cfg['blocks']} blocks relu(l2(relu(l1(x)))) + x, width {cfg['width']}, batch {cfg['batch']}; "
                    "loss = output.sum()")


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


RESNET_SIZES = {"tiny": dict(width=8, stages=(1, 1), batch=4, image=16),
                "quick": dict(width=16, stages=(2, 2, 2), batch=16, image=32),
                "full": dict(width=32, stages=(2, 2, 2), batch=8, image=64)}


def resnet(size: str) -> Workload:
    cfg = RESNET_SIZES[size]
    model = ResNet(cfg["width"], cfg["stages"])
    b, s = cfg["batch"], cfg["image"]
    inputs = (torch.randn(b, 3, s, s), torch.randint(0, 10, (b,)))
    return Workload("resnet", model, inputs, [model.stem, *model.layers],
                    f"ResNet-style, basic blocks {cfg['stages']} per stage, width {cfg['width']}, BatchNorm, "
                    f"batch {b}, {s}x{s} images; loss = cross-entropy")


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


UNET_SIZES = {"tiny": dict(width=4, depth=2, batch=2, image=16),
              "quick": dict(width=8, depth=3, batch=4, image=64),
              "full": dict(width=16, depth=3, batch=4, image=128)}


def unet(size: str) -> Workload:
    cfg = UNET_SIZES[size]
    model = UNet(cfg["width"], cfg["depth"])
    b, s = cfg["batch"], cfg["image"]
    inputs = (torch.randn(b, 3, s, s), torch.randint(0, 4, (b, s, s)))
    return Workload("unet", model, inputs, [*model.down, *model.dec],
                    f"U-Net-style, depth {cfg['depth']}, width {cfg['width']}, batch {b}, {s}x{s} images, "
                    "4 classes; loss = per-pixel cross-entropy")


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


# ---------------------------------------------------------------- GPT-2-style LM (fxopt.models)
GPT_SIZES = {"tiny": dict(layers=2, dim=32, heads=2, seq=32, batch=2, vocab=128),
             "quick": dict(layers=2, dim=128, heads=4, seq=128, batch=8, vocab=1024),
             "full": dict(layers=4, dim=256, heads=4, seq=256, batch=4, vocab=4096)}


def gpt2(size: str) -> Workload:
    cfg = GPT_SIZES[size]
    model = _init_like_gpt2(GPT(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], max_seq=cfg["seq"], dropout=0.0))
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    return Workload("gpt2", model, (idx, torch.roll(idx, -1, dims=1)), list(model.h),
                    f"GPT-2 architecture (fxopt.models.GPT: pre-LN, SDPA causal attention, tied embeddings), "
                    f"{cfg['layers']} layers, width {cfg['dim']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
                    f"batch {cfg['batch']} x {cfg['seq']} tokens, dropout 0; loss = LM cross-entropy")


# ---------------------------------------------------------------- BERT-style encoder
class BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + attn(x)); x = LN(x + FFN(x)), GELU, attention written
    out (scores and probabilities materialized, as in BERT's reference code) with an additive
    padding mask."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ffn_in = nn.Linear(dim, 4 * dim)
        self.ffn_out = nn.Linear(4 * dim, dim)
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


BERT_SIZES = {"tiny": dict(layers=2, dim=32, heads=2, seq=32, batch=2, vocab=128),
              "quick": dict(layers=2, dim=128, heads=4, seq=128, batch=8, vocab=1024),
              "full": dict(layers=4, dim=256, heads=4, seq=256, batch=2, vocab=4096)}


def bert(size: str) -> Workload:
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


MODELS: dict[str, Callable[[str], Workload]] = {
    "residual_mlp": mlp,
    "resnet": resnet,
    "unet": unet,
    "gpt2": gpt2,
    "bert": bert,
}
