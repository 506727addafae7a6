"""Tensors reachable from a value, and their storages: what the analysis sizes, what a step holds
resident, what a measured peak starts from. One walk, so that all three count the same bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

StorageKey = tuple[str, int | None, Any]  # (device type, device index, data pointer; a fake storage's id)


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds for ``t``: its local shard for a DTensor (FSDP2's sharded
    parameters and gradients), ``t`` itself otherwise."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(t, dtensor):
        with torch.no_grad():
            return t.to_local()
    return t


def tensors_in(obj: Any, *, grads: bool = False) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``: tensors, modules' parameters and buffers, optimizers'
    parameters and state, through lists, tuples and dicts; with ``grads``, tensors' gradients too.
    A DTensor stands for its local shard (what this process holds, see `local`)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            found.append(local(o))
            if grads and o.grad is not None:
                found.append(local(o.grad))
        elif isinstance(o, torch.nn.Module):
            stack.extend(reversed([*o.parameters(), *o.buffers()]))
        elif isinstance(o, torch.optim.Optimizer):
            state = [v for s in o.state.values() for v in s.values()]
            stack.extend(reversed([*(p for g in o.param_groups for p in g["params"]), *state]))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return found


def storage_bytes(t: torch.Tensor) -> int | torch.SymInt:
    """Bytes of the storage under ``t`` (all of it, not only the part ``t`` views); a ``SymInt``
    for a fake tensor of symbolic shape (never turned into an int: that would be a guard)."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): use their elements
        nbytes = t.numel() * t.element_size()
    return nbytes if isinstance(nbytes, torch.SymInt) else int(nbytes)


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """What identifies the storage under ``t`` (None for a tensor without real storage)."""
    try:
        if isinstance(t, FakeTensor):  # (no data pointer: the storage object is what is shared)
            return t.device.type, t.device.index, ("fake", t.untyped_storage()._cdata)
        return t.device.type, t.device.index, t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - fake, meta or sparse tensors: nothing to match
        return None


def storages(obj: Any, *, grads: bool = False, device_type: str | None = None) -> dict[StorageKey, int]:
    """Bytes of each distinct storage reachable from ``obj`` (see `tensors_in`), optionally only
    those on devices of ``device_type``."""
    out = {}
    for t in tensors_in(obj, grads=grads):
        key = storage_key(t)
        if key is not None and (device_type is None or t.device.type == device_type):
            out[key] = storage_bytes(t)
    return out


def storage_refs(obj: Any) -> dict[StorageKey, Any]:
    """A weak reference to each distinct storage reachable from ``obj`` (see `tensors_in`), by its
    key: ``ref.expired()`` says whether the storage has been freed since (views and autograd's
    saved tensors keep it alive, where the tensor object itself may be gone)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = {}
    for t in tensors_in(obj):
        key = storage_key(t)
        if key is not None:
            out[key] = StorageWeakRef(t.untyped_storage())
    return out
