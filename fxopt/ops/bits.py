"""The ``bits`` codec of `fxopt.analysis.codecs` as torch.library custom ops: a bool tensor packed 8
elements to a byte (``pack_bits``) and back (``unpack_bits``). ``unpack(pack(m))`` equals ``m``
exactly, so gradients stay bit-identical to eager.
"""

from __future__ import annotations

import torch


# pack_bits(x, threshold, mode): bit k of byte j is 1 where element 8j + k of x is "on": x itself
# for a bool mask (mode 0), x <= threshold (mode 1). One op, so that what the backward needs is one
# value made from forward values, which the forward can compute and SAVE.
@torch.library.custom_op("fxopt::pack_bits", mutates_args=())
def pack_bits(x: torch.Tensor, threshold: float, mode: int) -> torch.Tensor:
    on = x if mode == 0 else x <= threshold
    flat = on.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


@pack_bits.register_fake
def _(x, threshold, mode):
    return x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op("fxopt::unpack_bits", mutates_args=())
def unpack_bits(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].ne(0).view(shape)


@unpack_bits.register_fake
def _(packed, shape):
    return packed.new_empty(shape, dtype=torch.bool)
