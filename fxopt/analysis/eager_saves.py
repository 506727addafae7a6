"""What eager autograd saves for each forward op: the tensors its autograd node holds until its
backward formula runs, which the joint graph does not always show.

AOTAutograd traces each backward formula into aten ops; a saved tensor the formula reads only for
its sizes leaves no edge in the graph, yet eager's autograd node keeps the whole tensor alive
until the formula runs. ``gather``'s formula, ``gather_backward(grad, self, dim, index)``, makes
``grad.new_zeros(self.sizes())``:

    joint graph:   g = gather(x, 1, idx)  ...  z = new_zeros(grad_g, [4, 16, 64]); scatter_add(z, 1, idx, grad_g)
    eager:         GatherBackward0 saves x (and idx): x lives until the backward reaches it

So each forward op is run once more on its fake inputs, those that require grad in the step
marked so, and what its autograd node saves (its ``_saved_*`` attributes) is matched, by
storage, to the op's inputs and outputs. `eager_saves` gives, per autograd node
(AOTAutograd's ``seq_nr``), the values it saves. Only the eager step's memory counts them
(`fxopt.solvers.Node.eager_reads`, `fxopt.solvers.eager_timeline`): fxopt's own backward holds
what its graph reads. An op that cannot be run so is taken to save every tensor input and output
(an autograd node saves nothing else): the eager peak may be above eager's, never below it.

A step of N copies of one block runs the same ops on the same shapes N times: an op is run once
per signature (`_signature`: its target, its arguments with each tensor's metadata, which of them
require grad and which share a storage), and its answer, in positions (the k-th input storage,
the j-th output item), is read for every later op of that signature.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxopt.storage import tensors_in


def eager_saves(fx_nodes: list[fx.Node], backward: set[fx.Node], gradients: list[fx.Node | None]) -> dict[int, list[fx.Node]]:
    """For each autograd node (``seq_nr``) with a backward formula in the graph, the values its
    forward op saves in eager (an output taken out of a tuple: the ``getitem`` that takes it).
    ``backward``: the backward nodes; ``gradients``: the gradient the step returns for each
    primal, in order (None where it has none). Which values require grad is autograd's answer
    too: each forward op is run in order, and its result requires grad or not (``ones_like(x)``
    does not, whatever ``x``)."""
    # (Only what AOTAutograd traced from aten formulas: a custom autograd.Function's forward
    # runs without recording, and its Python backward carries a stale sequence number.)
    formulas = {n.meta.get("seq_nr") for n in backward
                if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_backward"}
    requires_grad = _primals_requiring_grad(fx_nodes, gradients)
    answers: dict[tuple, tuple[list[tuple[str, int]], list[bool | None]]] = {}
    out: dict[int, list[fx.Node]] = {}
    for n in fx_nodes:
        if (n in backward or n.op != "call_function" or n.target is operator.getitem  # (with its op, below)
                or not any(a in requires_grad for a in n.all_input_nodes)):
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            if _differentiable(n.meta.get("val")):
                requires_grad.add(n)
            continue
        recorded = n.meta.get("partitioner_tag") == "is_forward"
        saved, items = _run_once(n, requires_grad, answers)
        for item, taker in zip(items, _takers(n, n.meta.get("val"))):
            if item is None or item:  # (None: not run, an upper bound)
                requires_grad.add(taker)
        if recorded and n.meta.get("seq_nr") in formulas and saved:
            out.setdefault(n.meta["seq_nr"], []).extend(saved)
    return out


def _primals_requiring_grad(fx_nodes: list[fx.Node], gradients: list[fx.Node | None]) -> set[fx.Node]:
    """The primals the step returns a gradient for."""
    primals = [n for n in fx_nodes if n.op == "placeholder" and n.name.startswith("primals")]
    if len(gradients) == len(primals):
        return {p for p, g in zip(primals, gradients) if g is not None}
    return {p for p in primals if _differentiable(p.meta.get("val"))}  # (a convention this does not know)


def _differentiable(val) -> bool:
    return any(t.is_floating_point() or t.is_complex() for t in tensors_in(val))


def _run_once(n: fx.Node, requires_grad: set[fx.Node], answers: dict) -> tuple[list[fx.Node], list[bool | None]]:
    """`_run`'s answer for ``n``, read from ``answers`` where an op of its signature was run
    before (and kept there where not: an op that would not run is run again each time)."""
    signature = _signature(n, requires_grad)
    if signature is None:
        return _run(n, requires_grad)
    key, inputs = signature
    if key in answers:
        positions, grads = answers[key]
        takers = _takers(n, n.meta.get("val"))
        return [inputs[k] if where == "in" else takers[k] for where, k in positions], list(grads)
    saved, grads = _run(n, requires_grad)
    takers = _takers(n, n.meta.get("val"))
    positions = []
    for s in saved:
        if s in inputs:
            positions.append(("in", inputs.index(s)))
        elif s in takers:
            positions.append(("out", takers.index(s)))
        else:  # (not an input nor an output of ``n``: nothing to read for another op)
            return saved, grads
    if None not in grads:  # (None: not run, see `_run`)
        answers[key] = (positions, grads)
    return saved, grads


def _signature(n: fx.Node, requires_grad: set[fx.Node]) -> tuple[tuple, list[fx.Node]] | None:
    """What `_run`'s answer for ``n`` depends on, hashable, and the node owning each input
    storage in the order `_run` meets them (the first to show it); None where an argument is
    not one this can key (then ``n`` is run). Two ops of one signature run the same kernel's
    autograd formula on tensors of the same metadata, the same of them requiring grad and the
    same of them sharing storage: their autograd nodes save the same positions."""
    storages: dict[StorageWeakRef, int] = {}
    owners: list[fx.Node] = []

    def key_of(a):
        if isinstance(a, (list, tuple)):
            return tuple(key_of(b) for b in a)
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat)):
                return ("value", str(v))
            if not isinstance(v, torch.Tensor):
                raise _Unkeyed
            storage = StorageWeakRef(v.untyped_storage())
            if storage not in storages:
                storages[storage] = len(owners)
                owners.append(a)
            return ("tensor", storages[storage], a in requires_grad and (v.is_floating_point() or v.is_complex()),
                    _sizes(v.shape), _sizes(v.stride()), _size(v.storage_offset()), _size(v.untyped_storage().nbytes()),
                    v.dtype, v.device, v.layout)
        if a is None or isinstance(a, (bool, int, float, str)):
            return (type(a).__name__, repr(a))  # (repr: -0.0 and 0.0 apart)
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(a).__name__, a)
        raise _Unkeyed

    try:  # (args, then kwargs in their order: the order `_run` meets the storages in)
        key = (n.target, key_of(n.args), key_of(list(n.kwargs.items())))
    except Exception:  # noqa: BLE001 - an argument this cannot key, or a tensor without storage: run it
        return None
    return key, owners


def _size(x):
    """A size as a key: an int, or a symbolic size's expression (equal expressions print alike,
    so the key is at least as fine as their text, whose printing took 2.2 of the 143 s of a
    profiled `fxopt.max_batch` on Llama-3-8B's shape)."""
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _sizes(xs) -> tuple:
    return tuple(map(_size, xs))


class _Unkeyed(Exception):
    """An argument `_signature` cannot key."""


def _run(n: fx.Node, requires_grad: set[fx.Node]) -> tuple[list[fx.Node], list[bool | None]]:
    """``n`` run on fake inputs, those of ``requires_grad`` requiring grad: the inputs and outputs
    its eager autograd node saves, and whether each item of its result requires grad."""
    fake_mode = next((t.fake_mode for t in tensors_in(n.meta.get("val")) if hasattr(t, "fake_mode")), None)
    owner: dict[StorageWeakRef, fx.Node] = {}

    def fake_input(a):
        if not isinstance(a, fx.Node):
            return a
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        t = v.detach()
        if a in requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_()
        owner.setdefault(StorageWeakRef(t.untyped_storage()), a)
        return t

    try:
        if fake_mode is None:
            raise RuntimeError("no fake tensors")
        with fake_mode, torch.enable_grad():
            args = fx.node.map_aggregate(n.args, fake_input)
            kwargs = fx.node.map_aggregate(n.kwargs, fake_input)
            result = n.target(*args, **kwargs)
            packed = [StorageWeakRef(t.untyped_storage()) for t in _saved_tensors(result)]
    except Exception:  # noqa: BLE001 - an op that will not run so: every tensor it touches, an upper bound
        every = [a for a in n.all_input_nodes if tensors_in(a.meta.get("val"))] + _outputs(n)
        return every, [None] * len(_items(n.meta.get("val")))
    for item, taker in zip(_items(result), _takers(n, result)):
        for t in tensors_in(item):
            owner.setdefault(StorageWeakRef(t.untyped_storage()), taker)
    grads = [any(t.requires_grad for t in tensors_in(item)) for item in _items(result)]
    return list(dict.fromkeys(owner[s] for s in packed if s in owner)), grads


def _saved_tensors(result) -> list[torch.Tensor]:
    """The tensors the autograd node that made ``result`` saves: its ``_saved_*`` attributes.
    (Not saved-tensor hooks: AOTAutograd turns those off while it compiles.)"""
    grad_fn = next((t.grad_fn for t in tensors_in(result) if t.grad_fn is not None), None)
    if grad_fn is None:
        return []
    saved = [getattr(grad_fn, name) for name in dir(grad_fn) if name.startswith("_saved_")]
    return tensors_in(saved)


def _items(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _takers(n: fx.Node, result) -> list[fx.Node]:
    """For each item of ``n``'s result, the node that holds it: the ``getitem`` taking it out of a
    tuple (the tuple itself for an item none takes), ``n`` for a single value."""
    if not isinstance(result, (list, tuple)):
        return [n]
    taken = {u.args[1]: u for u in n.users if u.target is operator.getitem}
    return [taken.get(k, n) for k in range(len(result))]


def _outputs(n: fx.Node) -> list[fx.Node]:
    val = n.meta.get("val")
    return list(dict.fromkeys(_takers(n, val))) if tensors_in(val) else []
