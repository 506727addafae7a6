"""``masked_scale``: dropout's ``x * mask * scale`` as one op (see `fxopt.passes.dropout`)."""

from __future__ import annotations

import torch


@torch.library.custom_op("fxopt::masked_scale", mutates_args=())
def masked_scale(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` where ``mask``, else 0, in one output buffer (no float copy of the mask)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device), out=out)
    return out.mul_(scale)


@masked_scale.register_fake
def _(x, mask, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
