"""FSDP2's ``fully_shard`` models planned as one graph: fxopt gathers the sharded parameters in its
own step, the way `fxopt.distributed.fsdp` does, instead of through FSDP2's hooks.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers a unit's parameters in a forward
pre-hook and reduce-scatters their gradients in backward hooks. Those hooks run outside any graph
(``torch._dynamo.disable``), so under torch.compile its step is one graph per block, which fxopt
could only plan piece by piece. While an fxopt step runs (its capture and every call, `gathering`):

  - FSDP2's forward hooks are taken off its units (and put back after, in their order), so none
    of its own all-gathers, reduce-scatters or backward hooks run;
  - each managed module reads its parameter through a property (a subclass swapped in for the
    call) that gathers it from this rank's padded shard, FSDP2's own ``_sharded_param_data``,
    with `fxopt.distributed.fsdp`'s ``gather`` (``all_gather_tensor_autograd``: its backward is a
    reduce-scatter). FSDP2 shards dim 0 in ``torch.chunk``'s pieces, each padded to the first's
    rows, so the shards laid end to end are the flattened parameter, zero-padded at the end:

        FSDP2:  x -[pre-hook: all-gather, copy out]-> layer(x, W) -[post-hook: free W]->
        fxopt:  x -> layer(x, view(all_gather(shard)[:numel], shape))     (one graph, planned)

  - with a ``MixedPrecisionPolicy`` (``param_dtype``/``reduce_dtype``), the shard is cast to
    ``param_dtype`` before its all-gather and the gradient to ``reduce_dtype`` before its
    reduce-scatter, back to the shard's dtype after (`fxopt.distributed.fsdp._GatherCast`), and
    FSDP2's casts of each unit's floating-point inputs (``cast_forward_inputs``) and outputs
    (``output_dtype``) run in hooks in the place of FSDP2's own forward hooks, so the step computes
    in the dtypes FSDP2's would;
  - the shard is a new autograd leaf over the same storage; once autograd has accumulated its
    gradient (the reduce-scatter's sum over ranks), a hook divides it by FSDP2's gradient divide
    factor (the world size by default: FSDP2 averages) and puts it, unpadded, on the DTensor
    parameter as a ``Shard(0)`` DTensor ``.grad``, adding to one already there, as FSDP2 does.

So FSDP2's state stays as it was: the module's parameters are FSDP2's sharded DTensors before,
during and after the step (the optimizer, ``state_dict`` and FSDP2's own eager calls see them),
with the gradients FSDP2 eager would give them. When to re-gather a parameter for the backward is
fxopt's decision (SAVE or RECOMPUTE of the gathered value, `fxopt.analysis.joint`), not
``reshard_after_forward``'s, and the ranks agree on one plan (`fxopt.distributed.fsdp.agreed_plan`).

A tied parameter (FSDP2's shared modules) is one leaf, read gathered under each of its names, so
its uses' gradients accumulate into one.

Refused (`check`), each with what to do, in one graph and in pieces alike: a ``CPUOffloadPolicy``,
a mesh of several dimensions (HSDP); in one graph also a unit FSDP2 holds unsharded when the step
starts; in pieces (`check_pieces`) a ``MixedPrecisionPolicy`` with ``param_dtype`` or
``reduce_dtype`` (the pieces' reserve does not count FSDP2's casts). Planned in pieces instead,
around FSDP2's own hooks, with a warning naming why (`not_one_graph`): a placement other than
``Shard(0)``, custom all-gather or reduce-scatter communication, an all-reduce hook,
``set_requires_gradient_sync(False)``.
``reshard_after_forward`` (any value) is FSDP2's choice for its hooks; in one graph fxopt's plan
makes it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn

from fxopt.distributed.fsdp import Gathered, casting_hooks, gather, reading_through
from fxopt.errors import CaptureError


@dataclasses.dataclass(frozen=True)
class Sharded:
    """One parameter FSDP2 shards: its ``FSDPParam`` and the param group it belongs to."""

    param: object  # torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam
    group: object  # ...FSDPParamGroup

    @property
    def module(self) -> nn.Module:
        return self.param._module_info.module

    @property
    def name(self) -> str:
        return self.param._module_info.param_name

    @property
    def uses(self) -> list[tuple[nn.Module, str]]:
        """Every (module, name) the parameter is registered under: one, or more where it is tied
        (an embedding shared with the output layer)."""
        info = self.param._module_info
        return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]

    @property
    def divide_factor(self) -> float:
        """What FSDP2 divides the reduce-scatter's sum by: the factor set on the unit
        (``set_gradient_divide_factor``), or the ranks' number (a mean)."""
        factor = self.group.gradient_divide_factor
        return float(factor) if factor is not None else float(self.group.mesh_info.shard_mesh_size)


def param_groups(state) -> list:
    """An FSDP2 unit's parameter groups: torch 2.13's ``_fsdp_param_groups`` (one per mesh), or,
    before it (torch 2.11, 2.12), its one ``_fsdp_param_group``; none where it manages no parameter."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def sharded_params(units: list[nn.Module]) -> list[Sharded]:
    """Every parameter FSDP2 shards for ``units``, in the units' order, each once."""
    out, seen = [], set()
    for unit in units:
        state = unit._get_fsdp_state()
        for group in param_groups(state):
            if id(group) in seen:
                continue
            seen.add(id(group))
            out.extend(Sharded(p, group) for p in group.fsdp_params)
    return out


FIX = "shard without it, or run FSDP2 without fxopt"


def check_pieces(units: list[nn.Module]) -> None:
    """Refuse what fxopt follows in one graph only, for a step FSDP2's hooks run in pieces."""
    for unit in units:
        mp = unit._get_fsdp_state()._mp_policy
        if mp.param_dtype is not None or mp.reduce_dtype is not None:
            raise CaptureError(
                "an FSDP2 unit has a MixedPrecisionPolicy with param_dtype/reduce_dtype, and this step is planned "
                "in pieces around FSDP2's hooks, whose reserve does not count the policy's casts: fxopt follows "
                "mixed precision in one graph only; drop the setting that needs FSDP2's hooks (the warning names "
                "it), or shard without the policy (torch.autocast inside the model is supported)")


def check(units: list[nn.Module]) -> None:
    """Refuse the FSDP2 settings whose memory fxopt does not count, in one graph or in pieces."""
    for s in sharded_params(units):
        where = f"(parameter {s.name} of {type(s.module).__name__})"
        if type(s.group.offload_policy).__name__ != "OffloadPolicy":
            raise CaptureError(f"an FSDP2 unit offloads its parameters (CPUOffloadPolicy) {where}: fxopt does not "
                               f"count or move the host copies; {FIX}")
        if s.param.sharded_param.device_mesh.ndim != 1:
            raise CaptureError(f"an FSDP2 unit shards over a mesh of several dimensions (HSDP) {where}: fxopt "
                               f"counts one-dimensional sharding only; {FIX}")


def not_one_graph(units: list[nn.Module]) -> str | None:
    """Why FSDP2's own hooks must run this step (so fxopt plans it in pieces), or None: the
    settings fxopt's gathering does not follow."""
    for s in sharded_params(units):
        group, where = s.group, f"parameter {s.name} of {type(s.module).__name__}"
        if s.param.fsdp_placement.dim != 0:
            return f"{where} is sharded along dimension {s.param.fsdp_placement.dim} (fxopt gathers Shard(0))"
        if type(group._all_gather_comm).__name__ != "DefaultAllGather" or \
                type(group._reduce_scatter_comm).__name__ != "DefaultReduceScatter" or \
                group._all_reduce_hook is not None:
            return (f"{where} has custom communication (set_custom_all_gather, set_custom_reduce_scatter or "
                    "set_all_reduce_hook), which only FSDP2's hooks run")
        if not group.reduce_grads:
            return (f"{where} does not reduce its gradients (set_requires_gradient_sync(False)), and fxopt's "
                    "graph reduce-scatters every gradient")
    return None


class OneGraph:
    """An FSDP2 model's step as one fxopt graph: `gathering` around every call."""

    def __init__(self, units: list[nn.Module]):
        self.units = units
        self.params = sharded_params(units)
        # One gathering subclass per managed module, made once: Dynamo's guards see the same class
        # at every call.
        self._classes: dict[int, type] = {}
        # Per unit, the hooks that cast as FSDP2's forward hooks would (mixed precision), made once
        # for the same reason.
        self._casts = {id(unit): casting_hooks(unit._get_fsdp_state()._mp_policy) for unit in units}

    def casts(self, unit: nn.Module) -> bool:
        """Whether ``unit`` casts its inputs or outputs in hooks while the step runs (mixed
        precision: `fxopt.distributed.fsdp.casting_hooks`)."""
        return any(h is not None for h in self._casts.get(id(unit), ()))

    def __getstate__(self) -> dict:
        # The gathering classes are made at run time, which pickle cannot name: made again.
        return {**self.__dict__, "_classes": {}}

    @contextlib.contextmanager
    def gathering(self):
        """While inside, FSDP2's forward hooks are off and every sharded parameter reads gathered
        from a new leaf over its shard, whose gradient lands on the DTensor parameter."""
        check(self.units)
        changed = not_one_graph(self.units)
        if changed is not None:
            raise CaptureError(f"this FSDP2 model's step is planned as one graph, but now {changed}: set it "
                               "before fxopt.optimize (fxopt then plans the step in pieces, around FSDP2's hooks)")
        self._lazy_init()
        with contextlib.ExitStack() as stack:
            for unit in self.units:
                stack.enter_context(_without_forward_hooks(unit, *self._casts[id(unit)]))
            reads: dict[int, tuple[nn.Module, dict]] = {}  # module -> (module, its parameters' shards)
            for s in self.params:
                leaf = _leaf(s)  # one per parameter, so that tied uses accumulate into one gradient
                for module, name in s.uses:
                    reads.setdefault(id(module), (module, {}))[1][name] = leaf
            for module, shards in reads.values():
                stack.enter_context(reading_through(module, self._classes, lambda cls: _gathering_class(cls, list(shards)),
                                                    "_fxopt_fsdp2_shards", shards))
            yield

    def _lazy_init(self) -> None:
        """What FSDP2 does before its first forward (find the root, re-pad shards that
        ``load_state_dict(assign=True)`` or ``.to()`` replaced), which its skipped hooks would do;
        refused where FSDP2 holds a unit unsharded now."""
        for unit in self.units:
            state = unit._get_fsdp_state()
            if state._is_root is None:
                state._lazy_init()
            for group in param_groups(state):
                if not group.is_sharded:
                    raise CaptureError(
                        f"FSDP2 holds {type(unit).__name__}'s parameters unsharded now (after unshard(), or a forward "
                        "without its backward, or reshard_after_forward=False after a forward): call reshard() on "
                        "the model's FSDP units before fxopt's step")
        for s in self.params:
            p = s.param
            if s.module._parameters.get(s.name) is not p.sharded_param or \
                    p.sharded_param._local_tensor.untyped_storage().data_ptr() != \
                    p._sharded_param_data.untyped_storage().data_ptr():
                p.reset_sharded_param()


def _leaf(s: Sharded):
    """This rank's padded shard of ``s`` as a new autograd leaf over FSDP2's storage, with what
    `gather` needs (the dtypes of FSDP2's mixed precision, as its lazy initialization clamped
    them); its accumulated gradient goes to the DTensor parameter (`_to_dtensor_grad`)."""
    param = s.param.sharded_param
    leaf = s.param._sharded_param_data.detach().requires_grad_(param.requires_grad)
    if param.requires_grad:
        leaf.register_post_accumulate_grad_hook(lambda t: _to_dtensor_grad(t, s))
    gathered = Gathered(param.numel(), param.shape, s.param.param_dtype, s.param.reduce_dtype)
    return leaf, gathered, s.param.mesh_info.shard_process_group


def _to_dtensor_grad(leaf: torch.Tensor, s: Sharded) -> None:
    """The reduce-scatter's sum on ``leaf`` as FSDP2's gradient of the DTensor parameter."""
    from torch.distributed.tensor import DTensor

    param = s.param.sharded_param
    local = param._local_tensor
    with torch.no_grad():
        grad = leaf.grad[:local.numel()].view(local.shape)
        if s.divide_factor != 1.0:
            grad.div_(s.divide_factor)
        leaf.grad = None
        if param.grad is None:
            param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape,
                                            stride=param.stride(), run_check=False)
        else:
            param.grad._local_tensor.add_(grad)


def _gathering_class(cls: type, names: list[str]) -> type:
    """A subclass of ``cls`` whose parameters ``names`` read gathered from their shards."""
    def reader(name: str):
        def get(self):
            shard, gathered, group = self.__dict__["_fxopt_fsdp2_shards"][name]
            return gather(shard, gathered, group)
        return property(get)

    return type(f"Gathered{cls.__name__}", (cls,), {name: reader(name) for name in names})


def _is_fsdp_hook(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("torch.distributed.fsdp")


@contextlib.contextmanager
def _without_forward_hooks(unit: nn.Module, pre=None, post=None):
    """``unit`` without FSDP2's forward pre- and post-hooks (its own, or those of a grouped
    ``fully_shard([a, b])``, all defined in torch.distributed.fsdp), ``pre`` and ``post`` (its
    mixed precision's casts, `fxopt.distributed.fsdp.casting_hooks`) in their places, under their ids (FSDP2's pre-hook
    takes keyword arguments); the module's hook dictionaries are the same objects after (FSDP2's
    handles remove from them), every hook in its place."""
    hooks = [unit._forward_pre_hooks, unit._forward_hooks]
    saved = [list(d.items()) for d in hooks]
    for d, instead in zip(hooks, (pre, post)):
        for i in [i for i, hook in d.items() if _is_fsdp_hook(hook)]:
            if instead is not None:
                d[i] = instead
            else:
                del d[i]
    try:
        yield
    finally:
        for d, items in zip(hooks, saved):
            d.clear()
            d.update(items)
