"""The ``int8`` / ``fp8`` / ``int4`` codecs of `fxopt.analysis.codecs` as torch.library custom ops:
``quantize(x)`` packs a floating-point tensor into one ``uint8`` buffer (payload, then one fp32
scale per group, then, with min/max scaling, one fp32 minimum per group); ``dequantize`` reverses
it. Built from plain torch ops, so they run on any device and under Inductor (as fallback
kernels). Stochastic rounding draws from fxopt's own generator, never torch's global one, so
dropout masks stay those of eager.
"""

from __future__ import annotations

import math

import torch

FORMAT_CODE = {"int8": 0, "fp8": 1, "int4": 2}
_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    if device not in _generators:
        g = torch.Generator(device=device)
        g.manual_seed(0x5EED)
        _generators[device] = g
    return _generators[device]


def layout(numel: int, group: int, fmt: int, minmax: bool) -> tuple[int, int, int]:
    """(groups, payload bytes, scale bytes) of a quantized buffer."""
    groups = -(-numel // group)
    payload = groups * group // 2 if fmt == 2 else groups * group
    scales = groups * 4 * (2 if minmax else 1)
    return groups, payload, scales


@torch.library.custom_op("fxopt::quantize", mutates_args=())
def quantize(x: torch.Tensor, fmt: int, group: int, minmax: bool, stochastic: bool) -> torch.Tensor:
    groups, payload, scales = layout(x.numel(), group, fmt, minmax)
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
    _, payload, scales = layout(x.numel(), group, fmt, minmax)
    return x.new_empty((payload + scales,), dtype=torch.uint8)


@torch.library.custom_op("fxopt::dequantize", mutates_args=())
def dequantize(buf: torch.Tensor, shape: list[int], dtype: torch.dtype, fmt: int, group: int,
               minmax: bool) -> torch.Tensor:
    numel = math.prod(shape)
    groups, payload, scales = layout(numel, group, fmt, minmax)
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
