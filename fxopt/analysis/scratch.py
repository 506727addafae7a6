"""Scratch memory of ops: bytes an op allocates while it runs beyond the outputs it returns; and
the bytes of the outputs themselves, as the real kernel allocates them.

CPU kernels allocate temporaries that no graph shows: convolution's im2col buffers (about twice
the input), ``native_dropout``'s float mask before it becomes a bool mask, the float copy of that
mask in ``native_dropout_backward``. A peak bound must count them, so each distinct op signature
(op, argument shapes, strides, dtypes, device, constants) is run once on made-up inputs of the
same layout and its allocations are measured: on CUDA with the allocator's statistics, on CPU
with ``torch.profiler`` memory events (one profiling session for all ops). The global RNG state
is restored afterwards, so measuring a random op changes no dropout mask.

The same run measures the storage under each output (`OpMemory.output_bytes`), which can be
larger than the fake tensor says: CPU ``mse_loss`` computes the elementwise loss into its output
and resizes it to the 0-dim mean in place, so the loss it returns keeps a storage the size of its
input (16 KiB under a 4-byte scalar), alive as long as the loss is.

Measurements are cached per process and on disk, next to the plan cache (`fxopt.cache`), in
``scratch/<machine>.json``: one file per torch version, CPU model, thread count and CUDA devices,
whose kernels may allocate differently. ``FXOPT_CACHE=0`` turns the disk cache off. An op that
could not be measured gets a conservative estimate (see `UNMEASURED_FACTOR`), never written to
disk, so it is measured again next time.

A device that is not here (a CUDA profile planned on this CPU, `fxopt.devices`) cannot be
measured, and its kernels are not the host's: nothing is run, and no host measurement stands in
for it. Its ops' scratch is a stated formula (`formula_memory`): ops known to allocate only their
outputs there (pointwise kernels, copies, factories; matrix products, whose cuBLAS workspace the
analysis counts once, resident) hold nothing beyond them; every other op is assumed to hold the
profile's ``scratch_factor`` times the bytes of its inputs and outputs: a bound, never zero.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import operator
import platform
from pathlib import Path

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fxopt import cache
from fxopt.analysis.costs import GATHERS, WAITS, group_backend
from fxopt.devices import DeviceProfile
from fxopt.fxgraph import aliases_input
from fxopt.storage import storage_bytes, storage_key, tensors_in

log = logging.getLogger("fxopt")

_cache: dict[tuple, int] = {}  # signature (thread count included) -> measured bytes, this process
_output_cache: dict[tuple, tuple[int, ...]] = {}  # signature -> measured bytes of each output
_on_disk: dict[Path, dict[str, int]] = {}  # disk cache file -> its entries, as read


def _signature(node: fx.Node, at) -> tuple:
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(map(at, v.shape)), tuple(map(at, v.stride())), str(v.dtype), str(v.device))
            return ("N", repr(at(v) if isinstance(v, torch.SymInt) else v))
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        return repr(a)

    # (A kernel's workspace depends on how many threads run it, and a process may change that.)
    return (torch.get_num_threads(), str(node.target), sig(tuple(node.args)),
            tuple(sorted((k, sig(v)) for k, v in node.kwargs.items())))


def _measurable(node: fx.Node, at) -> bool:
    if not _may_measure(node):
        return False
    outs = _outs(node)
    return bool(outs) and not any(at(o.numel()) == 0 for o in outs)


def _may_measure(node: fx.Node) -> bool:
    """`_measurable` but for its outputs' sizes: an op (not a ``getitem``) that mutates nothing
    and is not a view (views allocate nothing: their output shares an input's storage)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
        return False
    return not (isinstance(node.meta.get("val"), torch.Tensor) and aliases_input(node.target))


def _real_args(node: fx.Node, at):
    def real(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                shape, stride, offset = tuple(map(at, v.shape)), tuple(map(at, v.stride())), at(v.storage_offset())
                size = sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
                base = torch.empty(size + offset, dtype=v.dtype, device=v.device)
                # Positive floats are safe for log, sqrt and division; zeros are valid indices,
                # targets and masks. A constant fill is ten times faster than random numbers
                # (logits-sized tensors are hundreds of MB) and allocates the same.
                base.fill_(0.5 if base.is_floating_point() or base.is_complex() else 0)
                return base.as_strided(shape, stride, offset)
            return at(v) if isinstance(v, torch.SymInt) else v
        return at(a) if isinstance(a, torch.SymInt) else a

    return torch.fx.node.map_aggregate(node.args, real), torch.fx.node.map_aggregate(node.kwargs, real)


# Ops whose CPU kernels allocate nothing but their outputs in float32/float64 when every input is
# dense (contiguous, or a contiguous matrix transposed, which BLAS reads as it is): the matrix
# products copy only operands of other layouts, and the softmax kernels work in their output.
# They are not run: the largest of a step (a language model's vocabulary projection, its
# log-softmax) take seconds each on a CPU and would be measured only to find their outputs.
# tests/test_analysis.py measures each to check.
_OUTPUTS_ONLY_ON_CPU = frozenset([
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._log_softmax.default, torch.ops.aten._log_softmax_backward_data.default,
    torch.ops.aten._softmax.default, torch.ops.aten._softmax_backward_data.default,
    torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss_backward.default,
])


def _collective_increase(node: fx.Node) -> int | None:
    """A functional collective's bytes while it runs (it is never run alone: every rank would
    have to run it too): its outputs, and a copy of them for an all-gather over gloo (which
    gathers into a flat buffer of its own, then copies out), or of its input for a reduce-scatter,
    which gloo reduces in (a bound for backends that reduce in place). An all-reduce allocates its
    output only (the copy of its input it reduces in place; measured with the profiler on 2 gloo
    ranks, 1 and 4 MiB: exactly the output) and leaves nothing past its wait; in place (a bucket,
    `fxopt.passes.coalesce`), nothing. A wait allocates nothing: it returns the tensor it waits on
    (`fxopt.analysis.joint` counts its value as that tensor's storage). None for any other op."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
        return None
    if target._opname in WAITS or target._schema.is_mutable:
        return 0  # (it returns the tensor it waits on, or the one it reduced in place)
    outs = sum(o.numel() * o.element_size() for o in _outs(node))
    if target._opname in GATHERS and group_backend(node) in ("gloo", None):
        outs *= 2
    if target._opname.startswith("reduce_scatter"):
        outs += sum(t.numel() * t.element_size() for a in node.all_input_nodes for t in tensors_in(a.meta.get("val")))
    return outs


def lingering_bytes(node: fx.Node, at=int) -> int:
    """Bytes a functional collective leaves allocated past its wait (`fxopt.solvers.graph.Node.lingers`):
    gloo's copy of a reduce-scatter's input, which its worker thread frees when it lets go of the
    work (measured on 2 ranks: as late as the issue of the next collective, some ops on). 0 for
    any other op and backend. ``at``: a size's value at the shape planned for (as `op_memory`'s)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
        return 0
    if not target._opname.startswith("reduce_scatter") or group_backend(node) not in ("gloo", None):
        return 0
    return sum(at(t.numel()) * t.element_size() for a in node.all_input_nodes for t in tensors_in(a.meta.get("val")))


def known_increase(node: fx.Node) -> int | None:
    """The bytes an op allocates while it runs, where that is known without running it (see
    `_OUTPUTS_ONLY_ON_CPU`, `_collective_increase`): its outputs'. None otherwise."""
    if (collective := _collective_increase(node)) is not None:
        return collective
    if node.op != "call_function" or node.target not in _OUTPUTS_ONLY_ON_CPU:
        return None
    outs = _outs(node)
    inputs = [t for a in node.all_input_nodes for t in tensors_in(a.meta.get("val"))]
    if not all(isinstance(x, int) for t in outs + inputs for x in (*t.shape, *t.stride(), t.storage_offset())):
        return None  # symbolic sizes: measured at the shape that stands for them
    floats = (torch.float32, torch.float64)
    if not outs or any(t.device.type != "cpu" for t in outs + inputs) or any(o.dtype not in floats for o in outs):
        return None
    if any(t.dtype not in floats + (torch.int64,) for t in inputs):  # (int64: a loss's targets)
        return None
    dense = lambda t: t.is_contiguous() or t.dim() >= 2 and t.transpose(-1, -2).is_contiguous()  # noqa: E731
    if not all(o.is_contiguous() and o.storage_offset() == 0 for o in outs) or not all(dense(t) for t in inputs):
        return None
    return sum(o.numel() * o.element_size() for o in outs)


@dataclasses.dataclass(frozen=True)
class OpMemory:
    """What an op allocates: ``increase``, the peak bytes while it runs (outputs included), and,
    where the op was run, ``output_bytes``: the bytes of the storage under each item of its result
    (one item for a single tensor; a storage counted at its first item), as the real kernel
    allocated them (empty where not measured: the fake tensors' sizes hold)."""

    increase: int
    output_bytes: tuple[int, ...] = ()


def op_increases(nodes: list[fx.Node], at=int, device: DeviceProfile | None = None) -> dict[fx.Node, int]:
    """For each measurable node, the peak bytes allocated while its op runs (outputs included):
    `known_increase` where it knows, else measured (or read from the cache of measurements).
    ``at``: the value of a size at the shape to measure at (a static graph's sizes are ints; see
    `fxopt.analysis.symbolic.Sizes.at`). ``device``: the profile planned for, where its scratch is
    not measured here: `formula_memory` instead."""
    return {n: m.increase for n, m in op_memory(nodes, at, device).items()}


def op_memory(nodes: list[fx.Node], at=int, device: DeviceProfile | None = None,
              formula: FormulaMemory | None = None) -> dict[fx.Node, OpMemory]:
    """`op_increases` with the measured bytes of each op's outputs (see `OpMemory`). ``formula``:
    where ``device``'s scratch is a formula, that formula of ``nodes`` found before (else found here)."""
    if device is not None and not device.scratch_measured:
        return (formula or FormulaMemory(nodes, device)).at(at)
    todo: dict[tuple, fx.Node] = {}
    keys: dict[fx.Node, tuple] = {}
    known: dict[fx.Node, OpMemory] = {}
    disk = _disk_entries()
    for n in nodes:
        if not _measurable(n, at):
            continue
        if (size := known_increase(n)) is not None:
            known[n] = OpMemory(size)
        else:
            k = _signature(n, at)
            keys[n] = k
            if k not in _cache and _digest(k) in disk and (outputs := _outputs_on_disk(disk, k, n)) is not None:
                _cache[k], _output_cache[k] = disk[_digest(k)], outputs
            if k not in _cache:
                todo.setdefault(k, n)
    if todo:
        with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(
            devices=sorted({v.device.index or 0 for n in todo.values() for v in _outs(n) if v.device.type == "cuda"}),
        ):
            measured = _measure(todo, at)
        _store({entry: value for k in measured for entry, value in _disk_form(k).items()})
    return known | {n: OpMemory(_cache[k], _output_cache.get(k, ())) for n, k in keys.items() if k in _cache}


aten = torch.ops.aten

# Ops whose CUDA kernels allocate only their outputs, besides those tagged pointwise (TensorIterator
# kernels, which write their output and nothing else): copies and factories; gathers and
# concatenations (``embedding`` is an ``index_select``; ``slice_backward`` zeros then copies); the
# softmax kernels (aten/src/ATen/native/cuda/SoftMax.cu: one pass per row, in registers and shared
# memory); and the matrix products, whose only scratch is the cuBLAS workspace, which the analysis
# counts once, resident from the step's start (`fxopt.analysis.joint.analyze`). Not here, so under
# the formula: attention, reductions, losses, ``embedding_dense_backward`` (which sorts its indices
# into buffers of its own), and every op not named.
_OUTPUTS_ONLY_ON_CUDA = frozenset([
    aten._to_copy.default, aten.copy.default, aten.fill.Scalar, aten.fill.Tensor,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.empty_strided.default,
    aten.scalar_tensor.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.new_full.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.arange.default, aten.arange.start, aten.arange.start_step,
    aten.embedding.default, aten.index_select.default, aten.cat.default, aten.constant_pad_nd.default,
    aten.slice_backward.default, aten.select_backward.default,
    aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
])
# Ops that return a view of their input's storage on CUDA as on the host (allocating nothing),
# though their schema does not say so.
_ALIASES_ON_CUDA = frozenset([aten._unsafe_view.default])


def outputs_only_on_cuda(node: fx.Node) -> bool:
    """Whether ``node``'s op allocates only its outputs on a CUDA device (see `_OUTPUTS_ONLY_ON_CUDA`)."""
    target = node.target
    return target in _OUTPUTS_ONLY_ON_CUDA or (isinstance(target, torch._ops.OpOverload)
                                              and torch.Tag.pointwise in target.tags)


def formula_memory(nodes: list[fx.Node], device: DeviceProfile, at=int) -> dict[fx.Node, OpMemory]:
    """`op_memory` for a device whose kernels cannot run here, by formula, nothing run: the
    outputs of an op known to allocate only them there (`outputs_only_on_cuda`); for any other op,
    ``device.scratch_factor`` times the bytes of its inputs and outputs on top of its outputs (a
    conservative bound, stated in the profile, never zero: attention's kernels, reductions, losses,
    embedding's backward allocate beyond their outputs, by amounts only that device could say)."""
    return FormulaMemory(nodes, device).at(at)


class FormulaMemory:
    """`formula_memory` of one graph at any shape: which ops it counts and the sizes it reads of
    each (their outputs', and for the formula their inputs') found once, and evaluated at each
    shape (`at`). A step captured with dynamic shapes is evaluated at every batch `fxopt.max_batch`
    tries: walking its fake values for each took 4.4 of the 143 s of a profiled `max_batch` on
    Llama-3-8B's shape (11 batches, 7,858 nodes)."""

    def __init__(self, nodes: list[fx.Node], device: DeviceProfile):
        self.device = device
        # (node, outputs' (numel, element size), its collective bytes or None, how it is counted:
        # "alias", "outputs" or "formula", inputs' (numel, element size) for the formula)
        self.ops: list[tuple] = []
        for n in nodes:
            if not _may_measure(n):
                continue
            outs = [(t.numel(), t.element_size()) for t in _outs(n)]
            if not outs:
                continue
            collective = _collective_increase(n)
            how = ("alias" if n.target in _ALIASES_ON_CUDA else "outputs" if outputs_only_on_cuda(n) else "formula")
            ins = ([(t.numel(), t.element_size()) for a in n.all_input_nodes for t in tensors_in(a.meta.get("val"))]
                   if collective is None and how == "formula" else [])
            self.ops.append((n, outs, collective, how, ins))

    def at(self, at=int) -> dict[fx.Node, OpMemory]:
        out = {}
        factor = self.device.scratch_factor
        for n, outs, collective, how, ins in self.ops:
            numels = [at(numel) for numel, _ in outs]
            if any(k == 0 for k in numels):
                continue
            outputs = sum(k * size for k, (_, size) in zip(numels, outs))
            if collective is not None:
                out[n] = OpMemory(collective)
            elif how == "alias":
                out[n] = OpMemory(0)
            elif how == "outputs":
                out[n] = OpMemory(outputs)
            else:
                inputs = sum(at(numel) * size for numel, size in ins)
                out[n] = OpMemory(outputs + round(factor * (inputs + outputs)))
        return out


def _items(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _output_storage_bytes(result, inputs) -> tuple[int, ...]:
    """Bytes of the storage under each item of an op's ``result`` that it allocated (not one of
    its ``inputs``'), each storage counted once, at its first item."""
    seen = {storage_key(t) for t in tensors_in(inputs)}
    out = []
    for item in _items(result):
        total = 0
        for t in tensors_in(item):
            key = storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                total += int(storage_bytes(t))
        out.append(total)
    return tuple(out)


def _disk_form(k: tuple) -> dict[str, int]:
    """A measurement as disk cache entries: the increase under the signature's digest, each
    output's bytes under the digest and its position (``<digest>/out<i>``)."""
    digest = _digest(k)
    return {digest: _cache[k], **{f"{digest}/out{i}": b for i, b in enumerate(_output_cache.get(k, ()))}}


def _outputs_on_disk(disk: dict[str, int], k: tuple, node: fx.Node) -> tuple[int, ...] | None:
    """The output bytes cached for ``k`` (None if the cache predates them: measured again)."""
    digest = _digest(k)
    count = len(_items(node.meta.get("val")))
    entries = [disk.get(f"{digest}/out{i}") for i in range(count)]
    return None if None in entries else tuple(entries)


def _digest(signature: tuple) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()[:24]


def machine_key() -> str:
    """What the measurements depend on besides the op: torch's version and build, the CPU, the
    number of threads (read at each call: a process may change it), the CUDA devices."""
    return hashlib.sha256(json.dumps([_host(), torch.get_num_threads()]).encode()).hexdigest()[:16]


@functools.cache
def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    cuda = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return json.dumps([torch.__version__, torch.version.cuda, platform.machine(), cpu, cuda])


def _disk_path() -> Path | None:
    return cache.directory() / "scratch" / f"{machine_key()}.json" if cache.enabled() else None


def _disk_entries() -> dict[str, int]:
    path = _disk_path()
    if path is None:
        return {}
    if path not in _on_disk:
        try:
            entries = json.loads(path.read_text()) if path.exists() else {}
            if not isinstance(entries, dict) or not all(isinstance(v, int) for v in entries.values()):
                raise ValueError("not a table of byte counts")
        except (OSError, ValueError) as err:
            log.info("fxopt: ignoring unreadable scratch cache %s (%s)", path, err)
            entries = {}
        _on_disk[path] = entries
    return _on_disk[path]


def _store(new: dict[str, int]) -> None:
    path = _disk_path()
    if path is None or not new:
        return
    entries = _disk_entries()
    entries.update(new)
    cache.write_table(path, entries, "scratch measurements")


def _outs(node: fx.Node) -> list[torch.Tensor]:
    return tensors_in(node.meta.get("val"))


# An op whose allocations cannot be measured is assumed to hold this many times the bytes of its
# inputs and outputs while it runs: more than any kernel measured so far (convolution's im2col
# buffers, the largest, are about twice its input). Never zero: an unmeasured op must not make
# the predicted peak smaller than the real one.
UNMEASURED_FACTOR = 2


def _unmeasured(node: fx.Node, why, at) -> int:
    """The allocation assumed for an op that could not be measured: a conservative estimate."""
    tensors = [*_outs(node), *(t for a in node.all_input_nodes for t in tensors_in(a.meta.get("val")))]
    assumed = UNMEASURED_FACTOR * sum(at(t.numel()) * t.element_size() for t in tensors)
    log.warning("fxopt: could not measure the scratch memory of %s (%s); assuming %d bytes, %d times its inputs "
                "and outputs", node.target, why, assumed, UNMEASURED_FACTOR)
    return assumed


def _measure(todo: dict[tuple, fx.Node], at) -> set[tuple]:
    """Measure each op of ``todo`` into ``_cache``; the signatures measured (not estimated)."""
    cpu = {k: n for k, n in todo.items() if all(o.device.type == "cpu" for o in _outs(n))}
    others = {k: n for k, n in todo.items() if k not in cpu}
    return _measure_cuda(others, at) | (_measure_cpu(cpu, at) if cpu else set())


def _measure_cuda(todo: dict[tuple, fx.Node], at) -> set[tuple]:
    measured = set()
    for k, n in todo.items():
        device = _outs(n)[0].device
        if device.type != "cuda":
            _cache[k] = _unmeasured(n, f"no allocator statistics on {device.type}", at)
            continue
        try:
            args, kwargs = _real_args(n, at)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            out = n.target(*args, **kwargs)
            torch.cuda.synchronize(device)
            _cache[k] = torch.cuda.max_memory_allocated(device) - start
            _output_cache[k] = _output_storage_bytes(out, (args, kwargs))
            measured.add(k)
            del out
        except Exception as err:  # noqa: BLE001 - an op that cannot run on made-up inputs
            _cache[k] = _unmeasured(n, err, at)
    return measured


def _measure_cpu(todo: dict[tuple, fx.Node], at) -> set[tuple]:
    """All ops in one profiling session, each inside a labelled range; an op's peak is the highest
    running sum of the memory events inside its range."""
    from torch.profiler import record_function

    from fxopt.cpu_memory import profile_cpu_memory

    runs: list[tuple[tuple, fx.Node, str]] = []
    with profile_cpu_memory(collect=False) as prof:  # (the cyclic collector is off while it runs)
        for idx, (k, n) in enumerate(todo.items()):
            label = f"fxopt_scratch_{idx}"
            args = kwargs = None
            try:
                args, kwargs = _real_args(n, at)
                with record_function(label):
                    out = n.target(*args, **kwargs)
                    outputs = _output_storage_bytes(out, (args, kwargs))
                    del out
                runs.append((k, n, label))
                _output_cache[k] = outputs
            except Exception as err:  # noqa: BLE001 - an op that cannot run on made-up inputs
                _cache[k] = _unmeasured(n, err, at)
            del args, kwargs
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    windows = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name().startswith("fxopt_scratch_")}
    measured = set()
    for k, n, label in runs:
        if label not in windows:
            _cache[k] = _unmeasured(n, "the profiler recorded no range for it", at)
            continue
        lo, hi = windows[label]
        live = top = 0
        for e in memory:
            if lo <= e.start_ns() <= hi:
                live += e.nbytes()
                top = max(top, live)
        _cache[k] = top
        measured.add(k)
    return measured


# The same op can take a few hundred bytes more in the step than alone (allocator and library
# bookkeeping); a small margin on measured scratch keeps the prediction an upper bound.
SCRATCH_MARGIN = 4096


def scratch_beyond_output(increase: int, own_bytes: int) -> int:
    """Bytes an op holds while it runs beyond its own storage. For a multi-output op that includes
    the outputs taken out by the getitems that follow it: they are allocated with the op."""
    extra = increase - own_bytes
    return extra + SCRATCH_MARGIN if extra > 0 else 0
