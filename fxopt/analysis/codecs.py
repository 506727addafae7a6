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

This file decides which value is offered which codec (`offered_codec`) and what each costs; the
codecs themselves are torch.library custom ops in `fxopt.ops`, and the rewrite that inserts them
is `fxopt.passes.recompute`.
"""

from __future__ import annotations

import dataclasses

import operator

import torch
import torch.fx as fx

import fxopt.ops  # noqa: F401 - registers the codecs' custom ops
from fxopt.analysis.scratch import SCRATCH_MARGIN, op_increases
from fxopt.analysis.symbolic import largest
from fxopt.devices import DeviceProfile
from fxopt.storage import storage_bytes
from fxopt.ops.quantize import FORMAT_CODE, layout
from fxopt.fxgraph import NodeBuilder, aliases_input
from fxopt.solvers.graph import LOSSY_FORMATS

aten = torch.ops.aten

__all__ = ["Quantize", "Codec", "QUANTIZE_FORMATS", "codec_for", "offered_codec", "codec_workspace", "resolve_quantize"]

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


# ------------------------------------------------------------------------------------ the codecs


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one value is compressed: ``name`` (shown in plans), whether it is ``lossless``, the
    compressed size, and the op calls that encode and decode it (see `compress_call`,
    `decompress_call`)."""

    name: str
    lossless: bool
    compressed_bytes: int | torch.SymInt
    compress_op: object
    compress_args: tuple
    decompress_op: object
    decompress_args: tuple  # after the buffer

    def elementwise_flops(self, numel):
        """Rough FLOPs of encoding plus decoding (a few per element; for the cost model)."""
        return (2 if self.lossless else 12) * numel


def codec_for(val, *, lossless: bool, quantize: Quantize | None, indices_of_pool: bool = False) -> Codec | None:
    """The codec fxopt offers for a SAVEd value with fake value ``val``, or None."""
    if not isinstance(val, torch.Tensor) or val.is_sparse or not val.is_contiguous():
        return None
    if largest(val.numel()) * val.element_size() < MIN_BYTES:  # (no symbolic product made: the same number)
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
        fmt = FORMAT_CODE[quantize.format]
        minmax = quantize.scaling == "minmax"
        _, payload, scales = layout(val.numel(), quantize.group_size, fmt, minmax)
        return Codec(quantize.name, False, payload + scales,
                     torch.ops.fxopt.quantize.default, (fmt, quantize.group_size, minmax, quantize.stochastic),
                     torch.ops.fxopt.dequantize.default, (shape, val.dtype, fmt, quantize.group_size, minmax))
    return None


def offered_codec(n: fx.Node, *, compress: bool, quantize: Quantize | None) -> Codec | None:
    """The codec the solver may choose for the forward value ``n`` (SAVEd, not a view), or None:
    lossless ones with ``compress``; ``quantize``'s where quantization error is safe (see below)."""
    if not compress and quantize is None:
        return None
    lossy = quantize if quantize is not None and _quantizable(n) else None
    return codec_for(n.meta.get("val"), lossless=compress, quantize=lossy, indices_of_pool=_is_pool_indices(n))


def codec_workspace(todo: dict[int, tuple[fx.Node, Codec]], at=int, device: DeviceProfile | None = None) -> dict[int, int]:
    """Measured scratch bytes of encoding and decoding each value (the larger), beyond the value
    and its encoding: the codec ops run on made-up tensors like any op (`fxopt.analysis.scratch`),
    at the shape ``at`` evaluates sizes at (see `fxopt.analysis.symbolic.Sizes.at`); for a
    ``device`` profile whose scratch is not measured here, its formula's."""
    graph = fx.Graph()
    pairs = {}
    for i, (node, codec) in todo.items():
        value = graph.placeholder(f"v{i}")
        value.meta["val"] = node.meta["val"]
        add = NodeBuilder(graph, value, value)
        concrete = fx.node.map_aggregate((codec.compress_args, codec.decompress_args),
                                         lambda x: at(x) if isinstance(x, torch.SymInt) else x)
        enc = add(codec.compress_op, value, *concrete[0])
        dec = add(codec.decompress_op, enc, *concrete[1])
        pairs[i] = (enc, dec, codec)
    increases = op_increases(list(graph.nodes), at, device)
    out = {}
    for i, (enc, dec, codec) in pairs.items():
        value_bytes = at(storage_bytes(todo[i][0].meta["val"]))
        extra = max(increases.get(enc, 0) - at(codec.compressed_bytes), increases.get(dec, 0) - value_bytes, 0)
        out[i] = extra + SCRATCH_MARGIN if extra else 0
    return out


# Values not offered to lossy codecs: quantization error in them is amplified by the backward.
# A log-probability's error becomes a relative error of its exp (int8 steps of log-probs spanning
# [-10, 0] are 8% errors); a softmax's small probabilities round to 0 under a group's absmax
# scale; a normalisation's backward re-standardises its input with the saved, exact statistics.
_LOSSY_UNSAFE_PRODUCERS = {aten._log_softmax.default, aten._softmax.default, aten.log_softmax.int,
                           aten.softmax.int}
_LOSSY_UNSAFE_READERS = {aten.native_batch_norm_backward.default, aten.native_group_norm_backward.default}


def _quantizable(n: fx.Node) -> bool:
    target = n.target
    if target in _LOSSY_UNSAFE_PRODUCERS or getattr(target, "__name__", "").startswith("_safe_softmax"):
        return False
    stack, seen = [n], set()
    while stack:  # readers of the value or of views of it
        v = stack.pop()
        for u in v.users:
            if u in seen:
                continue
            seen.add(u)
            t = u.target
            if t in _LOSSY_UNSAFE_READERS or getattr(t, "__name__", "").startswith("cudnn_batch_norm_backward"):
                return False
            if aliases_input(t):
                stack.append(u)
    return True


def _is_pool_indices(n: fx.Node) -> bool:
    if n.target is not operator.getitem or n.args[1] != 1:
        return False
    src = n.args[0]
    return isinstance(src, fx.Node) and src.target in (aten.max_pool2d_with_indices.default,
                                                       aten.max_pool3d_with_indices.default)


