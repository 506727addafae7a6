"""Data parallel steps through fxopt: what DDP adds to each rank's peak, and how fxopt's one-graph
step runs under it.

DDP (``torch.nn.parallel.DistributedDataParallel``) in either order:

    DDP(fxopt.optimize(model, budget))      fxopt.optimize(DDP(model), budget)

Both run DDP's own forward (its pre- and post-forward work: buffer broadcast, the reducer's
bookkeeping) eagerly, and the wrapped module's step as one fxopt graph. In the second order fxopt
compiles ``ddp.module`` and routes DDP's call of it to the compiled step (`routed`), as
``nn.Module.compile`` would. Dynamo's DDP optimizer, which would split the graph at bucket
boundaries so that each bucket's all-reduce overlaps the rest of the backward, is off while fxopt
compiles (``torch._dynamo.config.optimize_ddp=False``): fxopt plans the whole step.

Gradients are reduced by DDP's own reducer: its hooks on the parameters' gradient accumulators
fire as autograd accumulates each gradient the compiled backward returns. So the all-reduces start
only after the whole backward has run: communication does not overlap the backward's compute
(it overlaps only the accumulation of later gradients). That is the cost of one plan for the whole
step; on a link fast enough to reduce every bucket in the optimizer's time it is small.

What DDP adds to the peak: its gradient buckets, one flat tensor per bucket, together as large as
the gradients of the parameters it reduces, allocated when the DDP is built and alive through
every step (also with ``gradient_as_bucket_view=True``, where the gradients are views of the
buckets between steps, while the backward's fresh gradients are still allocated and copied in).
fxopt counts them (`bucket_bytes`) as resident memory the step does not read; a step captured in
pieces counts them in every piece's reserve (`fxopt.capture.pieces`).

Refused, with the reason: a DDP built for compiled autograd (``optimize_ddp="python_reducer"``),
communication hooks (``register_comm_hook``: they allocate what fxopt cannot see), DDP's
``mixed_precision`` and delayed all-reduce parameters (buffers fxopt does not count).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from fxopt.errors import CaptureError
from fxopt.storage import storage_bytes, storage_key


def _ddp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def is_ddp(module: Any) -> bool:
    cls = _ddp_class()
    return cls is not None and isinstance(module, cls)


def running_ddp(module: nn.Module) -> nn.Module | None:
    """The DDP whose forward is calling ``module`` now (``DDP(fxopt.optimize(model))``), or None."""
    cls = _ddp_class()
    if cls is None:
        return None
    ddp = cls._get_active_ddp_module()
    return ddp if ddp is not None and ddp.module is module else None


def check_ddp(ddp: nn.Module) -> None:
    """Refuse what fxopt cannot bound or run under DDP (see the module docstring)."""
    fix = "; use DDP's defaults there, or run fxopt without DDP"
    if getattr(ddp, "_use_python_reducer", False):
        raise CaptureError(
            "this DDP was built with torch._dynamo.config.optimize_ddp='python_reducer', whose reducer "
            "all-reduces only under compiled autograd, which fxopt does not use: build the DDP with "
            "the default optimize_ddp setting")
    if getattr(ddp, "_comm_hooks", None):
        raise CaptureError(
            "this DDP has a communication hook (register_comm_hook): it allocates buffers of its own "
            f"while gradients are reduced, which fxopt cannot count in the budget{fix}")
    if getattr(ddp, "mixed_precision", None) is not None:
        raise CaptureError(
            "this DDP casts parameters for mixed_precision=, copies fxopt does not count in the budget"
            f"{fix} (torch.autocast inside the model is supported)")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise CaptureError(
            "this DDP delays the all-reduce of some parameters (delay_all_reduce_named_params=), into a "
            f"buffer fxopt does not count in the budget{fix}")


def bucket_bytes(ddp: nn.Module) -> int:
    """Bytes of DDP's gradient buckets, as its reducer reports them (alive through every step)."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
    if sizes is None:
        raise CaptureError("this DDP does not report its gradient buckets' sizes, so fxopt cannot count "
                           "them in the budget")
    return sum(int(s) for s in str(sizes).replace(",", " ").split())


def held_bytes(objs: Any) -> int:
    """Bytes that the DDPs among ``objs`` (a DDP, or an fxopt module of one) hold and no reachable
    tensor shows: their gradient buckets, less those the parameters' gradients are views of
    (``gradient_as_bucket_view=True``), which a walk of the model's tensors already finds."""
    found = {}
    for o in objs if isinstance(objs, (list, tuple)) else [objs]:
        for candidate in (o, getattr(o, "__dict__", {}).get("_model")):
            if is_ddp(candidate):
                found[id(candidate)] = candidate
    total = 0
    for ddp in found.values():
        seen = {}
        if ddp.gradient_as_bucket_view:
            for p in ddp.module.parameters():
                if p.grad is not None and storage_key(p.grad) is not None:
                    seen[storage_key(p.grad)] = storage_bytes(p.grad)
        total += max(0, bucket_bytes(ddp) - sum(seen.values()))
    return total


def module_call(module: nn.Module):
    """A function that calls ``module`` as ``module(...)`` does (hooks, then forward), for
    torch.compile to capture. It enters at ``_call_impl``, past the check for a compiled call that
    `routed` installs, so that tracing it does not meet the compiled call itself."""
    def call(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    return call


@contextlib.contextmanager
def routed(module: nn.Module, compiled_call):
    """While inside, calling ``module`` runs ``compiled_call`` instead (what ``nn.Module.compile``
    installs for good): DDP's forward, calling its wrapped module, runs fxopt's step."""
    previous = module._compiled_call_impl
    module._compiled_call_impl = compiled_call
    try:
        yield
    finally:
        module._compiled_call_impl = previous
