"""COMPRESS: keep a SAVEd activation in a smaller form between the forward and the backward.

A compressed value is made as usual in the forward, used by the forward, then, right after its
last forward use, encoded (``compress``) into one ``uint8`` buffer and freed; the buffer is what
the forward saves. The backward decodes it (``decompress``) just before its first read. Which
values are compressed is the solver's choice, per tensor, against SAVE and RECOMPUTE: each
codec's compressed size and (de)compression time are in the cost model (`Codec.compressed_bytes`,
`codec_seconds`).

Codecs:
  - ``bits`` (lossless, on by default): a ``bool`` tensor (a dropout mask, a comparison, the
    ``out <= 0`` that ReLU's backward reads, see `fxopt.passes.masks`) as packed bits: 8× smaller.
  - ``int32`` (lossless, on by default): max-pooling's ``int64`` indices, which index one input
    plane, as ``int32``: 2× smaller.
  - ``int8`` / ``fp8`` / ``int4`` (lossy, opt-in with ``quantize=``): floating-point activations
    quantized per group of ``group_size`` consecutive elements, with one fp32 scale per group
    (absmax scaling) or a scale and a minimum (min/max scaling), optionally with stochastic
    rounding. ``int8``: about 4× smaller than fp32; ``fp8`` (e4m3): 4×; ``int4``: about 8×.

All codecs are torch.library custom ops built from plain torch ops, so they run on any device and
under Inductor (as fallback kernels). Stochastic rounding draws from fxopt's own generator, never
from torch's global one, so dropout masks stay those of eager.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fxopt.solvers.graph import LOSSY_FORMATS

__all__ = ["Quantize", "Codec", "QUANTIZE_FORMATS", "codec_for", "resolve_quantize", "gradient_sqnr", "sqnr_db"]

QUANTIZE_FORMATS = LOSSY_FORMATS  # the codec names `fxopt.solvers` treats as lossy
SCALINGS = ("absmax", "minmax")

# Tensors smaller than this many bytes are never compressed: the two extra ops cost more than
# the bytes saved.
MIN_BYTES = 4096

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Quantize:
    """Lossy compression of SAVEd floating-point activations (opt-in).

    ``format``: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"``. ``group_size``: consecutive elements
    sharing one scale (smaller: more accurate, more scale bytes). ``scaling``: ``"absmax"``
    (symmetric, one scale per group) or ``"minmax"`` (asymmetric, a scale and a minimum per group;
    not for fp8). ``stochastic``: stochastic rounding (unbiased; integer formats only)."""

    format: str = "int8"
    group_size: int = 64
    scaling: str = "absmax"
    stochastic: bool = False

    def __post_init__(self):
        if self.format not in QUANTIZE_FORMATS:
            raise ValueError(f"unknown quantize format {self.format!r}; choose one of {', '.join(QUANTIZE_FORMATS)}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; choose one of {', '.join(SCALINGS)}")
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even integer >= 2, got {self.group_size!r}")
        if self.format == "fp8" and (self.scaling != "absmax" or self.stochastic):
            raise ValueError("fp8 supports absmax scaling without stochastic rounding")

    @property
    def name(self) -> str:
        extra = "" if self.scaling == "absmax" else "-minmax"
        extra += "-sr" if self.stochastic else ""
        return f"{self.format}/g{self.group_size}{extra}"


def resolve_quantize(quantize) -> Quantize | None:
    """``None``/``False`` (off), a format name, or a `Quantize`."""
    if quantize is None or quantize is False:
        return None
    if isinstance(quantize, Quantize):
        return quantize
    if isinstance(quantize, str):
        return Quantize(quantize)
    raise TypeError(f"quantize must be None, one of {', '.join(QUANTIZE_FORMATS)} or fxopt.Quantize, got {quantize!r}")


# --------------------------------------------------------------------------------------- the ops

_FORMAT_CODE = {"int8": 0, "fp8": 1, "int4": 2}
_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    if device not in _generators:
        g = torch.Generator(device=device)
        g.manual_seed(0x5EED)
        _generators[device] = g
    return _generators[device]


def _layout(numel: int, group: int, fmt: int, minmax: bool) -> tuple[int, int, int]:
    """(groups, payload bytes, scale bytes) of a quantized buffer."""
    groups = -(-numel // group)
    payload = groups * group // 2 if fmt == 2 else groups * group
    scales = groups * 4 * (2 if minmax else 1)
    return groups, payload, scales


@torch.library.custom_op("fxopt::quantize", mutates_args=())
def quantize(x: torch.Tensor, fmt: int, group: int, minmax: bool, stochastic: bool) -> torch.Tensor:
    groups, payload, scales = _layout(x.numel(), group, fmt, minmax)
    out = torch.empty(payload + scales, dtype=torch.uint8, device=x.device)
    flat = x.detach().reshape(-1)
    pad = groups * group - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    g = flat.view(groups, group)
    scale_out = out[payload:payload + groups * 4].view(torch.float32).view(groups, 1)
    if fmt == 1:  # fp8 e4m3, absmax scaled onto its largest finite value
        scale_out.copy_(g.abs().amax(dim=1, keepdim=True)).div_(448.0).clamp_min_(1e-30)
        out[:payload].view(torch.float8_e4m3fn).view(groups, group).copy_(g / scale_out)
        return out
    levels = 255 if fmt == 0 else 15
    if minmax:
        lo = g.amin(dim=1, keepdim=True).float()
        scale_out.copy_((g.amax(dim=1, keepdim=True).float() - lo) / levels).clamp_min_(1e-30)
        t = (g - lo).div_(scale_out)  # in [0, levels]
        out[payload + groups * 4:].view(torch.float32).copy_(lo.view(-1))
    else:
        half = levels // 2  # int8: [-127, 127]; int4: [-7, 7]
        scale_out.copy_(g.abs().amax(dim=1, keepdim=True).float() / half).clamp_min_(1e-30)
        t = (g / scale_out).add_(half + 1)  # in [1, levels]
    if stochastic:
        t.add_(torch.rand(t.shape, generator=_generator(t.device), device=t.device, dtype=t.dtype)).floor_()
    else:
        t.round_()
    t.clamp_(0, levels)
    if fmt == 2:
        pairs = t.view(-1, 2)
        q = out[:payload]
        q.copy_(pairs[:, 1])
        q.bitwise_left_shift_(4).bitwise_or_(pairs[:, 0].to(torch.uint8))
    else:
        out[:payload].copy_(t.view(-1))
    return out


@quantize.register_fake
def _(x, fmt, group, minmax, stochastic):
    _, payload, scales = _layout(x.numel(), group, fmt, minmax)
    return x.new_empty((payload + scales,), dtype=torch.uint8)


@torch.library.custom_op("fxopt::dequantize", mutates_args=())
def dequantize(buf: torch.Tensor, shape: list[int], dtype: torch.dtype, fmt: int, group: int,
               minmax: bool) -> torch.Tensor:
    numel = math.prod(shape)
    groups, payload, scales = _layout(numel, group, fmt, minmax)
    scale = buf[payload:payload + groups * 4].view(torch.float32).view(groups, 1)
    exact = groups * group == numel
    work = dtype if exact else torch.float32
    out = torch.empty(groups * group, dtype=work, device=buf.device)
    g = out.view(groups, group)
    if fmt == 1:
        g.copy_(buf[:payload].view(torch.float8_e4m3fn).view(groups, group))
        g.mul_(scale)
    else:
        q = buf[:payload]
        if fmt == 2:
            pairs = out.view(-1, 2)
            pairs[:, 0].copy_(q & 0xF)
            pairs[:, 1].copy_(q >> 4)
        else:
            out.copy_(q)
        if minmax:
            g.mul_(scale).add_(buf[payload + groups * 4:payload + scales].view(torch.float32).view(groups, 1))
        else:
            g.sub_((255 if fmt == 0 else 15) // 2 + 1).mul_(scale)
    if exact:
        return out.view(shape)
    return out[:numel].view(shape).to(dtype)


@dequantize.register_fake
def _(buf, shape, dtype, fmt, group, minmax):
    return buf.new_empty(shape, dtype=dtype)


# ------------------------------------------------------------------------------------ the codecs


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one value is compressed: ``name`` (shown in plans), whether it is ``lossless``, the
    compressed size, and the op calls that encode and decode it (see `compress_call`,
    `decompress_call`)."""

    name: str
    lossless: bool
    compressed_bytes: int
    compress_op: object
    compress_args: tuple
    decompress_op: object
    decompress_args: tuple  # after the buffer

    def elementwise_flops(self, numel: int) -> int:
        """Rough FLOPs of encoding plus decoding (a few per element; for the cost model)."""
        return (2 if self.lossless else 12) * numel


def codec_for(val, *, lossless: bool, quantize: Quantize | None, indices_of_pool: bool = False) -> Codec | None:
    """The codec fxopt offers for a SAVEd value with fake value ``val``, or None."""
    if not isinstance(val, torch.Tensor) or val.is_sparse or not val.is_contiguous():
        return None
    nbytes = val.numel() * val.element_size()
    if nbytes < MIN_BYTES:
        return None
    shape = list(val.shape)
    if lossless and val.dtype == torch.bool:
        return Codec("bits", True, (val.numel() + 7) // 8,
                     torch.ops.fxopt.pack_bits.default, (0.0, 0),
                     torch.ops.fxopt.unpack_bits.default, (shape,))
    if lossless and indices_of_pool and val.dtype == torch.int64:
        return Codec("int32", True, val.numel() * 4,
                     torch.ops.prims.convert_element_type.default, (torch.int32,),
                     torch.ops.prims.convert_element_type.default, (torch.int64,))
    if quantize is not None and val.dtype in _FLOAT_DTYPES:
        fmt = _FORMAT_CODE[quantize.format]
        minmax = quantize.scaling == "minmax"
        _, payload, scales = _layout(val.numel(), quantize.group_size, fmt, minmax)
        return Codec(quantize.name, False, payload + scales,
                     torch.ops.fxopt.quantize.default, (fmt, quantize.group_size, minmax, quantize.stochastic),
                     torch.ops.fxopt.dequantize.default, (shape, val.dtype, fmt, quantize.group_size, minmax))
    return None


# `pack_bits`/`unpack_bits` live with the mask passes; import them so their ops are registered.
from fxopt.passes import masks as _masks  # noqa: E402,F401


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference``, in dB
    (``inf`` when they are equal)."""
    ref = reference.detach().double()
    noise = (approx.detach().double() - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def gradient_sqnr(reference: torch.nn.Module, other: torch.nn.Module) -> dict[str, float]:
    """Per parameter, the SQNR (dB) of ``other``'s gradient against ``reference``'s, after one
    step of each on the same inputs (e.g. eager against ``fxopt.optimize(..., quantize="int8")``).
    Parameters without a gradient in either are left out."""
    out = {}
    for (name, p), (_, q) in zip(reference.named_parameters(), other.named_parameters()):
        if p.grad is not None and q.grad is not None:
            out[name] = sqnr_db(p.grad, q.grad)
    return out
