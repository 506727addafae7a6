"""DDP's step as one graph: the gradients' all-reduces inside fxopt's plan, not after it.

Eager DDP (``torch.nn.parallel.DistributedDataParallel``) reduces gradients in its reducer's hooks
on the parameters' gradient accumulators. Under an fxopt step those hooks fire only as autograd
accumulates the gradients the compiled backward returns, after the whole backward. So while
fxopt runs a step of ``fxopt.optimize(DDP(model))`` (`OneGraph.reducing`):

  - DDP's forward runs under its own ``no_sync()``: the reducer is not prepared for a backward,
    so its hooks return at once (no second reduction); DDP's buffer broadcast before the forward
    still runs, and after the call DDP is left as a synchronized forward leaves it
    (``require_forward_param_sync``), so the next forward broadcasts buffers as DDP would;
  - each module of ``ddp.module`` reads its parameters through a property (a subclass swapped in
    for the call, as `fxopt.distributed.fsdp2` does) that returns ``_AverageInBackward(p)``: the
    identity forward, whose backward is a functional all-reduce of the gradient of that read,
    scaled by ``1 / world size`` first as DDP's reducer does:

        DDP:    ... backward ... (done) -> reducer hooks: bucket copy, all_reduce, copy out
        fxopt:  ... g_W = mm(...); all_reduce(mul(g_W, 1/n), "sum", group); wait ... (one graph)

So each all-reduce is a node of the joint graph, and before the step is analysed the planner
coalesces consecutive ones into buckets as DDP's reducer does (`fxopt.passes.coalesce`, DDP's
default sizes: 1 MiB first, then 25 MiB; ``bucket_cap_mb`` is not followed): each bucket's
all-reduce is issued where its last gradient is complete, its wait as late as its first reader
(`fxopt.passes.waits`), its buffers values the simulator counts (`fxopt.analysis.scratch`),
priced as communication (`fxopt.analysis.costs`), never recomputed, and the ranks agree on one
plan (`fxopt.distributed.fsdp.agreed_plan`). The gradients land in ``param.grad`` averaged over
the ranks, as DDP puts them, as views of their reduced bucket (one storage per bucket, freed with
the last of its gradients); DDP's own buckets stay allocated (and counted) and unused by the step.

A parameter is read through the property once per use: a tied parameter (one tensor under two
names), or one a module reads twice, is all-reduced once per read, the partial gradients summing
to the same total. A parameter read other than as a module attribute (``module._parameters``,
``module.parameters()`` inside a forward) would not be reduced: torch's recurrent layers
(``nn.RNNBase``: LSTM, GRU, RNN) read theirs from a list, so a model with one keeps the reducer.

A step runs DDP's reducer as before (`reducing` changes nothing) when a gradient is already
there as it starts (gradient accumulation: DDP reduces the accumulated gradient, which the
graph's all-reduce of this step's part alone would not), inside the user's own ``no_sync()``, or
for a DDP that has run under ``torch.distributed.algorithms.Join`` (uneven inputs; DDP keeps its
join switch on after the context).
Settings only the reducer follows keep it for every step, with a warning naming why
(`not_one_graph`): ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, a
recurrent layer.
``DDP(fxopt.optimize(model))`` (fxopt inside DDP) keeps the reducer too: DDP prepares it after
fxopt's step has returned.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol

from fxopt.storage import module_tensors, submodules

class _AverageInBackward(torch.autograd.Function):
    """The identity; its backward all-reduces the gradient over ``group_name``, scaled by ``scale``."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, group_name: str, scale: float) -> torch.Tensor:
        ctx.group_name, ctx.scale = group_name, scale
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad * ctx.scale, "sum", ctx.group_name), None, None


def not_one_graph(ddp: nn.Module) -> str | None:
    """Why this DDP's reducer must reduce its gradients (so fxopt keeps it), or None."""
    if ddp.find_unused_parameters:
        return ("it finds unused parameters (find_unused_parameters=True), which only DDP's reducer does "
                "(it marks them ready for every rank)")
    if ddp.static_graph:
        return "it is built with static_graph=True, whose first steps only DDP's reducer follows"
    if ddp.gradient_as_bucket_view:
        return ("its gradients are views of its buckets (gradient_as_bucket_view=True), which only DDP's "
                "reducer fills")
    rnn = next((m for m in ddp.module.modules() if isinstance(m, nn.RNNBase)), None)
    if rnn is not None:
        return (f"its {type(rnn).__name__} reads its weights from a list (_flat_weights), not as attributes, "
                "which fxopt's all-reduces follow")
    return None


class OneGraph:
    """A DDP's step with its gradients' all-reduces in fxopt's graph: `reducing` around every call."""

    def __init__(self, ddp: nn.Module):
        self.ddp = ddp
        # One reading subclass per module, made once: Dynamo's guards see the same class at every call.
        self._classes: dict[int, type] = {}

    def __getstate__(self) -> dict:
        # The reading classes are made at run time, which pickle cannot name: made again.
        return {**self.__dict__, "_classes": {}}

    def applies(self) -> bool:
        """Whether this call's step reduces in the graph: DDP synchronizes this step (not inside the
        user's ``no_sync()``), not under ``Join`` (whose joined ranks shadow the reducer's
        all-reduces, not the graph's), and it starts with no gradient held (else the reducer
        reduces the accumulated gradient, as eager DDP does)."""
        ddp = self.ddp
        join = getattr(ddp, "_join_config", None)
        if not ddp.require_backward_grad_sync or join is not None and join.enable:
            return False
        for p in module_tensors(ddp.module)[0]:  # (a loop, not a generator: this runs at every call)
            if p.grad is not None:
                return False
        return True

    @contextlib.contextmanager
    def reducing(self):
        """While inside (around DDP's forward), DDP's reducer is off and every parameter reads
        through `_AverageInBackward`; a step `applies` does not run as eager DDP does."""
        if not self.applies():
            yield
            return
        ddp = self.ddp
        group = ddp.process_group
        with ddp.no_sync():
            swapped = self._read_through_averages((group.group_name, 1.0 / group.size()))
            try:
                yield
            finally:
                _restore(swapped)
        # What DDP's post-forward sets after a synchronized forward (under no_sync it cleared it):
        # the next forward broadcasts the buffers (broadcast_buffers=True) as eager DDP's would.
        ddp.require_forward_param_sync = torch.is_grad_enabled()

    def _read_through_averages(self, reduce: tuple[str, float]) -> list[tuple[nn.Module, type]]:
        """Every module of the DDP with a trainable parameter as its reading subclass, made once
        per module with ``reduce`` (group name, scale) in it (`fxopt.distributed.fsdp.reading_through`'s
        swap, for all of them in one loop). This runs at every call: no module's ``__dict__`` is
        written (Dynamo's guards on it see the same dictionary each call), and the class is set as
        ``nn.Module.__setattr__`` would set it, without its checks (two Python calls a module).
        The modules swapped and their own classes."""
        swapped: list[tuple[nn.Module, type]] = []
        try:
            for module in submodules(self.ddp.module):
                for p in module._parameters.values():
                    if p is not None and p.requires_grad:
                        break
                else:
                    continue
                cls = type(module)
                reading = self._classes.get(id(module))
                if reading is None:
                    names = [n for n, p in module._parameters.items() if p is not None and p.requires_grad]
                    reading = self._classes[id(module)] = _reducing_class(cls, names, reduce)
                object.__setattr__(module, "__class__", reading)
                swapped.append((module, cls))
        except BaseException:
            _restore(swapped)
            raise
        return swapped


def _restore(swapped: list[tuple[nn.Module, type]]) -> None:
    for module, cls in reversed(swapped):
        object.__setattr__(module, "__class__", cls)


def _reducing_class(cls: type, names: list[str], reduce: tuple[str, float]) -> type:
    """A subclass of ``cls`` whose parameters ``names`` read through `_AverageInBackward`, over
    the group named ``reduce[0]``, scaled by ``reduce[1]``."""
    group_name, scale = reduce

    def reader(name: str):
        def get(self):
            return _AverageInBackward.apply(self._parameters[name], group_name, scale)
        return property(get)

    return type(f"Reduced{cls.__name__}", (cls,), {name: reader(name) for name in names})
