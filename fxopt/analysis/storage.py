"""Tensors inside a node's value, and the bytes of their storage."""

from __future__ import annotations

import torch


def tensors_in(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in tensors_in(v)]
    return []


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): use their elements
        return t.numel() * t.element_size()
