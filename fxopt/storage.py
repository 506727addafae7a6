"""Tensors reachable from a value, and their storages: what the analysis sizes, what a step holds
resident, what a measured peak starts from. One walk, so that all three count the same bytes."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

StorageKey = tuple[str, int | None, Any]  # (device type, device index, data pointer; a fake storage's id)


@functools.cache
def _dtensor_class() -> type | None:
    """DTensor, where torch was built with distributed (looked up once: `local` runs for every
    tensor of every call of an optimized step)."""
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


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, each once, as ``module.modules()`` gives them, in one walk
    (torch's walk resumes a generator per level of nesting for every module it yields; DDP's step
    swaps the classes of the modules at every call, `fxopt.distributed.ddp`)."""
    out: list = []
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack += reversed(m._modules.values())
    return out


def module_tensors(module: torch.nn.Module, *, remove_duplicate: bool = True
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters and the buffers of ``module`` and its submodules, as ``module.parameters()``
    and ``module.buffers()`` give them (``remove_duplicate=False``: each as often as it is
    registered, a tied weight under each of its names, as ``named_parameters(remove_duplicate=False)``),
    in one walk of the modules. torch walks them with a chain of generators, one per level of
    nesting, once for the parameters and once for the buffers, and hashes every tensor: 4,300
    Python calls per call of an optimized step of a small transformers ResNet (89 modules), where
    fxopt's own bookkeeping walks the model at every call (`fxopt.capture.pieces.Step`)."""
    params: list = []
    buffers: list = []
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if m is None:  # (a submodule registered as None)
            continue
        if remove_duplicate:
            if id(m) in seen:
                continue
            seen.add(id(m))
        params += m._parameters.values()
        buffers += m._buffers.values()
        stack += reversed(m._modules.values())  # (pre-order, children in registration order, as torch)
    if remove_duplicate:
        return (list({id(p): p for p in params if p is not None}.values()),
                list({id(b): b for b in buffers if b is not None}.values()))
    return [p for p in params if p is not None], [b for b in buffers if b is not None]


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
            params, buffers = module_tensors(o)
            stack.extend(reversed([*params, *buffers]))
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
        storage = t.untyped_storage()
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): use their elements
        storage = None
    return _bytes(t, storage)


def _bytes(t: torch.Tensor, storage) -> int | torch.SymInt:
    try:
        nbytes = storage.nbytes()
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): use their elements
        nbytes = t.numel() * t.element_size()
    return nbytes if isinstance(nbytes, torch.SymInt) else int(nbytes)


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """What identifies the storage under ``t`` (None for a tensor without real storage)."""
    try:
        return _key(t, t.untyped_storage())
    except Exception:  # noqa: BLE001 - fake, meta or sparse tensors: nothing to match
        return None


def _key(t: torch.Tensor, storage) -> StorageKey | None:
    try:
        device = t.device  # (made anew at each access)
        if isinstance(t, FakeTensor):  # (no data pointer: the storage object is what is shared)
            return device.type, device.index, ("fake", storage._cdata)
        return device.type, device.index, storage.data_ptr()
    except Exception:  # noqa: BLE001 - fake, meta or sparse tensors: nothing to match
        return None


def storages(obj: Any, *, grads: bool = False, device_type: str | None = None) -> dict[StorageKey, int]:
    """Bytes of each distinct storage reachable from ``obj`` (see `tensors_in`), optionally only
    those on devices of ``device_type``."""
    out = {}
    for t in tensors_in(obj, grads=grads):
        if device_type is not None and t.device.type != device_type:
            continue
        try:
            storage = t.untyped_storage()  # (one storage object for both: made anew at each call)
        except Exception:  # noqa: BLE001 - sparse, nested: no storage, nothing to match
            continue
        key = _key(t, storage)
        if key is not None:
            out[key] = _bytes(t, storage)
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
