"""Fully sharded data parallel as one graph: each parameter kept as this rank's shard, gathered
whole where the model reads it, inside the step fxopt captures (SimpleFSDP's form, torchtitan's
``experiments/graph_trainer/simple_fsdp.py``).

``fully_shard(model)`` replaces every parameter of ``model`` by this rank's shard of it: the
parameter flattened, padded to a multiple of the world size and cut in equal pieces, one per rank
(the shards are the module's parameters, under the same names: the optimizer and ``state_dict``
see shards). Reading the parameter (``module.weight``) gathers it whole with
``torch.distributed._functional_collectives.all_gather_tensor_autograd``, whose backward is a
reduce-scatter: each rank's shard gets the sum over ranks of the gradient of its part. So under
``torch.compile`` (and ``fxopt.optimize``) the whole step is one graph, the all-gathers and
reduce-scatters inside it (``_c10d_functional`` ops), and the gathered parameters are values of the
step like any activation.

Gradients are a sum over ranks; for the mean of the ranks' losses, divide each rank's loss by the
world size (or average as a mean loss over the whole batch would). Buffers stay replicated.

Mixed precision as FSDP2 does it (``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``, FSDP2's own policy class): each shard is cast to ``param_dtype``
before its all-gather (gathered in bf16), the gathered parameter's gradient cast to
``reduce_dtype`` before its reduce-scatter, and the reduced shard cast back to the shard's dtype:

    x -> layer(x, view(all_gather(to(shard, bf16))[:numel], shape))
         backward: to(reduce_scatter(to(g_W, fp32)), shard dtype)

one ``torch.autograd.Function`` (`_GatherCast`) that Dynamo traces into the step's one graph, so
the casts, the bf16 all-gathers and the fp32 reduce-scatters are nodes the plan sizes and prices
in their own dtypes. The model's floating-point inputs are cast to ``param_dtype`` as FSDP2's root
casts them (``cast_forward_inputs``), its outputs to ``output_dtype`` where one is set.

What this is not (yet): meshes of several dimensions. FSDP2's own ``fully_shard`` models are
gathered the same way (`gather`) by `fxopt.distributed.fsdp2`, their state kept FSDP2's.
"""

from __future__ import annotations

import collections
import contextlib
import math
import pickle
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol


@contextlib.contextmanager
def reading_through(module: nn.Module, classes: dict[int, type], make: Callable[[type], type], key: str, value):
    """``module`` as an instance of ``make(type(module))`` while inside, with ``value`` under ``key``
    in its ``__dict__`` (what the subclass's parameter properties read). The subclass is made once
    per module and kept in ``classes``, so Dynamo's guards see the same class on every call. Used
    by FSDP2's one graph (`fxopt.distributed.fsdp2`) and DDP's (`fxopt.distributed.ddp`)."""
    cls = type(module)
    if id(module) not in classes:
        classes[id(module)] = make(cls)
    module.__dict__[key] = value
    module.__class__ = classes[id(module)]
    try:
        yield
    finally:
        module.__class__ = cls
        del module.__dict__[key]


class Gathered(NamedTuple):
    """What reading one sharded parameter gathers: its whole size and shape, and the dtypes it is
    gathered and its gradient reduced in (None: the shard's own, as FSDP2 clamps them:
    `dtypes_of`)."""

    numel: int
    shape: torch.Size
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def dtypes_of(orig: torch.dtype, policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of a parameter of dtype ``orig`` under a
    ``MixedPrecisionPolicy`` (or None), clamped as FSDP2 clamps them (``FSDPParam.init_dtype_attrs``):
    no reduce dtype where it is the param dtype, no param dtype where it is the parameter's own or
    the parameter is not floating-point."""
    if policy is None:
        return None, None
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig or not orig.is_floating_point:
        param_dtype = None
    return param_dtype, reduce_dtype


class _GatherCast(torch.autograd.Function):
    """The whole parameter from each rank's shard cast to ``param_dtype``; its backward casts the
    gradient to ``reduce_dtype``, reduce-scatters it (a sum over ranks) and returns it in the
    shard's dtype. FSDP2's mixed precision as functional collectives: Dynamo traces both
    directions into the step's graph (a cast, an all-gather and its wait; a cast, a
    reduce-scatter and its wait)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group_name: str, param_dtype, reduce_dtype) -> torch.Tensor:
        ctx.group_name, ctx.reduce_dtype, ctx.shard_dtype = group_name, reduce_dtype, shard.dtype
        return funcol.all_gather_tensor(shard if param_dtype is None else shard.to(param_dtype), 0, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_dtype is not None:
            grad = grad.to(ctx.reduce_dtype)
        reduced = funcol.reduce_scatter_tensor(grad, "sum", 0, ctx.group_name)
        return reduced.to(ctx.shard_dtype), None, None, None


def gather(shard: torch.Tensor, gathered: Gathered, group) -> torch.Tensor:
    """The whole parameter from each rank's shard (its backward reduce-scatters the gradient), in
    ``gathered.param_dtype`` where one is set (`_GatherCast`)."""
    if gathered.param_dtype is None and gathered.reduce_dtype is None:
        full = funcol.all_gather_tensor_autograd(shard, 0, group)
    else:
        name = group if isinstance(group, str) else group.group_name
        full = _GatherCast.apply(shard, name, gathered.param_dtype, gathered.reduce_dtype)
    return full[:gathered.numel].view(gathered.shape)


def cast_floating(dtype: torch.dtype | None, tree):
    """``tree`` with every floating-point tensor in it cast to ``dtype`` (FSDP2's
    ``cast_forward_inputs``, its own helpers); unchanged for None."""
    if dtype is None:
        return tree
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), tree)


def _shard_of(p: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    flat = p.detach().reshape(-1)
    rows = math.ceil(flat.numel() / world)
    padded = torch.nn.functional.pad(flat, (0, rows * world - flat.numel()))
    return padded[rank * rows:(rank + 1) * rows].clone()


def _sharded_class(cls: type, names: dict[str, Gathered], group) -> type:
    """A subclass of ``cls`` whose parameters ``names`` read gathered from their shards."""
    def reader(name: str, gathered: Gathered):
        def get(self):
            return gather(self._parameters[name], gathered, group)
        return property(get)

    attrs = {name: reader(name, gathered) for name, gathered in names.items()}
    return type(f"Sharded{cls.__name__}", (cls,), attrs)


def is_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` sharded a module of ``model``."""
    return any(getattr(m, "_fxopt_sharded", None) for m in model.modules())


def fully_shard(model: nn.Module, group: dist.ProcessGroup | None = None, *, mp_policy=None) -> nn.Module:
    """Shard every parameter of ``model`` over ``group`` (default: the world), in place; returns
    ``model``. Every rank must pass the same model (the same parameters, as after the same seed or
    a broadcast): each keeps its own part. Tied parameters (one tensor under several names) keep
    one shard. ``mp_policy``: FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``, followed as
    FSDP2 follows it (see the module docstring): parameters gathered in ``param_dtype``, gradients
    reduced in ``reduce_dtype`` and kept in the shards' dtype, the model's floating-point inputs
    cast to ``param_dtype`` (``cast_forward_inputs``) and its outputs to ``output_dtype``."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("fxopt.distributed.fully_shard needs a process group: call "
                           "torch.distributed.init_process_group first")
    if is_sharded(model):
        raise ValueError("this model is sharded already (fxopt.distributed.fully_shard was called on it)")
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("this model is sharded by FSDP2's fully_shard already: shard it with one of the two")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, not {type(mp_policy).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        names = {}
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in shards:
                shards[id(p)] = nn.Parameter(_shard_of(p, rank, world), requires_grad=p.requires_grad)
            module._parameters[name] = shards[id(p)]
            names[name] = Gathered(p.numel(), p.shape, *dtypes_of(p.dtype, mp_policy))
        if names:
            module.__class__ = _sharded_class(module.__class__, names, group)
            module._fxopt_sharded = names
    if mp_policy is not None:
        _cast_at_root(model, mp_policy)
    return model


def _cast_at_root(model: nn.Module, policy) -> None:
    """Hooks on ``model`` that cast its floating-point inputs to ``policy.param_dtype`` and its
    outputs to ``policy.output_dtype``, as FSDP2's root unit does (its
    ``_cast_forward_inputs``/``_cast_output_dtype``). Hooks, not a forward wrapper, so that Dynamo
    traces them into the step."""
    pre, post = casting_hooks(policy)
    if pre is not None:
        model.register_forward_pre_hook(pre, with_kwargs=True)
    if post is not None:
        model.register_forward_hook(post)


def casting_hooks(policy) -> tuple:
    """(pre, post): forward hooks that cast as FSDP2's unit hooks do under ``policy``
    (``_cast_forward_inputs``: floating-point inputs to ``param_dtype`` where
    ``cast_forward_inputs``; ``_cast_output_dtype``: outputs to ``output_dtype``), each None where
    FSDP2's casts nothing. ``pre`` takes keyword arguments (``with_kwargs=True``)."""
    pre = post = None
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        in_dtype = policy.param_dtype

        def pre(module, args, kwargs):
            return cast_floating(in_dtype, (args, kwargs))
        pre.casts = True
    if policy.output_dtype is not None:
        out_dtype = policy.output_dtype

        def post(module, args, output):
            return cast_floating(out_dtype, output)
        post.casts = True
    return pre, post


def casts_at(module: nn.Module) -> bool:
    """Whether ``module`` has one of `casting_hooks`'s hooks now. Dynamo runs the hooks of the
    module it compiles outside the graph, unless it compiles a call of the module (as
    `fxopt.distributed.data_parallel.module_call` makes), which it traces hooks and all."""
    return any(getattr(h, "casts", False) for d in (module._forward_pre_hooks, module._forward_hooks) for h in d.values())


def full_tensor(model: nn.Module, name: str, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The whole parameter ``name`` of a `fully_shard` model (or ``tensor``, a shard of its shape,
    such as its gradient), gathered from every rank outside any graph."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    gathered = module._fxopt_sharded[attr]
    shard = module._parameters[attr] if tensor is None else tensor
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard.detach().contiguous())
    return torch.cat(parts)[:gathered.numel].view(gathered.shape)


def collective_group(joint) -> str | None:
    """The name of the process group a captured step's functional collectives run over (the
    first one's), or None for a step without collectives."""
    for n in joint.graph.nodes:
        t = n.target
        if isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional" and n.args:
            if isinstance(n.args[-1], str):
                return n.args[-1]
    return None


# The tensors this process handed to gloo from Python, kept referenced for a while. gloo's worker
# thread drops its work (its references to them) a moment after the wait returns, holding its
# queue's lock; if that was a tensor's last reference, freeing it needs the GIL, which the main
# thread holds while it queues the next collective on that lock: both ranks then hang (seen on
# torch 2.13 with two broadcasts back to back, `broadcast_object_list`'s). Referenced here, a
# tensor outlives the worker's release.
_HANDED_TO_GLOO: collections.deque = collections.deque(maxlen=64)


def held_for_gloo(*tensors: torch.Tensor) -> None:
    """Keep referenced, for a while, tensors handed to a gloo collective from Python (see
    `_HANDED_TO_GLOO`)."""
    _HANDED_TO_GLOO.extend(tensors)


# How many objects each process group has agreed on through the store so far: every rank counts
# the same agreements in the same order (each compile of a step with collectives makes one), so
# the count names the store key both sides use.
_AGREEMENTS: collections.Counter = collections.Counter()


def object_from_rank(obj, src: int, group):
    """``obj`` (picklable) from global rank ``src`` on every rank of ``group``, through c10d's
    store rather than a collective: rank ``src`` sets a key, the others read it (the store's reads
    release the GIL while they wait) and the last reader deletes it. A gloo broadcast here could
    hang both ranks: gloo's worker thread drops a finished work's tensors holding its queue's lock,
    and where that is a Python-made tensor's last reference (an FSDP2 hook's collective, one of
    the step's), freeing it needs the GIL, which the caller of the next collective holds while it
    waits for that lock (seen in CI: one rank in ``ProcessGroupGloo::enqueue`` of the plan's
    broadcast, the other in its wait)."""
    store = dist.distributed_c10d._get_default_store()  # (torch has no public getter for it)
    name = group.group_name
    key = f"fxopt/agreed/{name}/{_AGREEMENTS[name]}"
    _AGREEMENTS[name] += 1
    if dist.get_rank() == src:
        store.set(key, pickle.dumps(obj))
        return obj
    agreed = pickle.loads(store.get(key))
    if store.add(f"{key}/read", 1) == dist.get_world_size(group) - 1:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return agreed


def agreed_plan(joint, plan):
    """Rank 0's plan of a step with collectives inside, on every rank of their group: the ranks
    must run the same collectives in the same order, and a plan the solvers' safety stop cut short
    (or a budget resolved from this rank's own measurements) may differ between ranks. Raises
    if rank 0 planned another graph."""
    name = collective_group(joint)
    if name is None or not dist.is_initialized():
        return plan
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(name)
    if dist.get_world_size(group) == 1:
        return plan
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # (planning runs inside Dynamo's fake mode; the exchange is real)
        agreed = object_from_rank(plan, dist.get_global_rank(group, 0), group)
    # (A plan with its ops reordered has another fingerprint: the planner puts the step in the
    # agreed plan's order, and checks the graph then.)
    if agreed.fingerprint != plan.fingerprint and not (agreed.reordered or plan.reordered):
        raise RuntimeError(
            "the ranks captured different graphs of a step with collectives inside (another model, "
            "input shape or dtype on some rank): every rank must run the same step")
    return agreed
