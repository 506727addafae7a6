"""Compile fxopt's forward and backward with Inductor without losing the plan.

With ``compiler="inductor"`` a budget given as a fraction is a share of the compiled step's peak:
what ``torch.compile(model)``'s own step measures (a whole step planned as one graph without
collectives; otherwise, and where it cannot be measured, of eager's predicted peak). The partition
asks for it first (`CompiledPeakWanted`): Inductor's own step is compiled as ``torch.compile(model)``
compiles it and run once on the example inputs, measured (`_measured_own_step`).

Where the budget admits that step (at least its measured peak, or eager's), or the plan changes
nothing, Inductor's own step stands in for the plan (`fxopt.capture.dynamo.own_step_bound`):
within the budget, it runs (the same code as plain Inductor's, none of the settings below), and
over it, the plan is compiled as below::

    plan (nothing to change) ─▶ Inductor's own step ─▶ one run, measured ─▶ within: run it
                                                                          └▶ over: fxopt's plan

Otherwise Inductor's own pipeline runs as for any torch.compile (``compile_fx``), with fxopt's
planner as its partitioner (``custom_partitioner_fn``): Inductor does not choose what to save or
recompute. The saved tensors are the forward's outputs fxopt chose, and the backward reads
exactly those.

fxopt's simulator predicts the memory of its modules run op by op in the schedule's order. Left to
its defaults, Inductor changes what is alive when, and so the peak. Measured on CPU, each of these
raised a plan's peak above the prediction, so each is changed here:

- Ops without an Inductor lowering become fallback kernels, whose inputs the backward first copies
  to contiguous memory: the modules are decomposed after partitioning (`fxopt.passes.decompose`),
  each op in place, random ops left whole.
- A pointwise value may be recomputed inside each reader instead of stored, keeping its inputs
  alive (a softmax re-derived from the attention scores after dropout keeps the scores): every
  value the simulator counts is written to memory where the schedule computes it
  (``inductor_realize_to_strides``). Fusion inside each op's decomposition remains.
- Horizontal fusion (independent kernels that read the same buffer) runs a recomputation as soon
  as its inputs exist, long before the schedule needs it (Inductor's comment on
  ``are_long_distant_nodes`` names activation checkpointing): refused. Vertical fusion places the
  fused kernel at its first member, pulling consumers earlier: allowed only between kernels
  adjacent in the schedule, and there only within one op's decomposition or where the fused
  kernel stays within the graph's peak run kernel by kernel (`_KernelMemory`: a fused kernel
  holds every member's outputs at once).
- An op's decomposition may write reductions to memory (a log-softmax's per-row maximum and sum)
  that its eager kernel does not: planned for Inductor, they are the op's workspace
  (`fxopt.planner._as_compiled`).
- ``reorder_for_peak_memory`` reorders by Inductor's own estimate: off. ``allow_buffer_reuse``
  keeps a dead buffer until a later one of the same size can take it over: off (the allocator
  reuses memory anyway).
- Layout optimization turns a graph with convolutions channels-last: the forward makes
  channels-last copies of its inputs and weights, which the simulator counts as resident, not as
  new memory, and saves the copies for the backward (ViT's patch embedding: +69632 B over the
  prediction at a 256 KB budget): off.
- The C++ backend collects consecutive kernels into one function whose outputs are all allocated
  before any of them runs: each kernel is flushed on its own.

Random ops run eager's kernels (``fallback_random``), so dropout masks are eager's. Numerics differ
from eager's by float rounding only (fused reductions sum in another order).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.choices import InductorChoices
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensor

from fxopt.cpu_memory import allocation_events, peak_increase, profile_cpu_memory
from fxopt.fxgraph import copy_module
from fxopt.passes.decompose import OP, decompose
from fxopt.storage import storages, tensors_in

log = logging.getLogger("fxopt")

_PACKAGE = Path(__file__).parent.parent
_SOURCES = tuple(str(_PACKAGE / name) for name in ("capture/inductor.py", "passes/decompose.py"))


# Under this key of a forward module's ``meta``, fxopt's partition offers Inductor's own step in
# place of its plan (a budget that admits eager's step, or a plan that changes nothing:
# `fxopt.capture.dynamo.own_step_bound`): the most the step's graph may hold, its inputs and all it
# allocates, for the plan's budget to hold.
OWN_STEP_BOUND = "fxopt_own_step_bound"


def inductor_backend(partition: Callable, inductor_config: dict[str, Any] | None = None) -> Callable:
    """A torch.compile backend: Inductor, with ``partition(joint, joint_inputs, *,
    num_fwd_outputs, **kw) -> (fw, bw)`` as its partitioner and the settings above; or, where the
    partition offers it (`OWN_STEP_BOUND`), Inductor's own step, if a run of it measures within
    the bound. Where the partition asks first what Inductor's own step holds
    (`CompiledPeakWanted`: a budget given as a share of the compiled step's peak), that step is
    compiled and measured, and the partition is called again with ``compiled_held=`` its bytes
    (None where it could not be measured). ``inductor_config``: more Inductor settings, applied
    last (to either)."""
    patches = {
        "inductor_choices_class": _KeepSchedule,
        "reorder_for_peak_memory": False,
        "allow_buffer_reuse": False,
        "fallback_random": True,
        "layout_optimization": False,
        **(inductor_config or {}),
    }

    def compile_inductor(gm: fx.GraphModule, example_inputs):
        log.info("fxopt: compiling the planned step with Inductor")
        partitioner = _Partitioner(partition)
        own = None  # Inductor's own step, once compiled and measured: (its step, the bytes it held)
        while True:
            try:
                return _compile_planned(_copy(gm), example_inputs, partitioner, patches)
            except CompiledPeakWanted:
                own = _measured_own_step(_copy(gm), example_inputs, inductor_config)
                partitioner.compiled_held = None if own is None else own[1]
            except _OwnStepOffered as offer:
                if own is None:
                    own = _measured_own_step(_copy(gm), example_inputs, inductor_config)
                if own is not None and own[1] <= offer.bound:
                    log.info("fxopt: running Inductor's own step: it measured %d bytes, within the %d its budget "
                             "leaves it", own[1], offer.bound)
                    return own[0]
                if own is not None:
                    log.info("fxopt: Inductor's own step measured %d bytes, over the %d its budget leaves it: "
                             "compiling fxopt's plan instead", own[1], offer.bound)
                partitioner.offered = offer  # (its modules, without planning again)
                return _compile_planned(gm, example_inputs, partitioner, patches)

    return compile_inductor


class CompiledPeakWanted(Exception):
    """Raised from a partition that needs to know what Inductor's own step holds before it plans
    (a fractional budget is a share of the compiled step's peak with ``compiler="inductor"``):
    `inductor_backend` compiles that step, measures it, and partitions again."""


def _compile_planned(gm: fx.GraphModule, example_inputs, partitioner: _Partitioner, patches: dict):
    # AOTAutograd's cache would hand back an earlier compile without calling the partitioner:
    # no plan, and not necessarily this budget's. (Inductor's cache of each module stays on.)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=_compile_one_kernel_per_call,
                          config_patches={**patches, "custom_partitioner_fn": partitioner}, decompositions={})


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's module for one compile (``compile_fx`` may change the module it is given)."""
    copy = copy_module(gm)
    copy.meta.update(gm.meta)
    copy.shape_env = getattr(gm, "shape_env", None)
    return copy


class _OwnStepOffered(Exception):
    """Raised from the partitioner where fxopt's partition offers Inductor's own step: ``bound``
    (`OWN_STEP_BOUND`), and fxopt's modules for ``joint_code``, to compile if it does not hold."""

    def __init__(self, bound: int, joint_code: str, fw: fx.GraphModule, bw: fx.GraphModule):
        super().__init__("Inductor's own step offered")
        self.bound, self.joint_code, self.fw, self.bw = bound, joint_code, fw, bw


def _measured_own_step(gm: fx.GraphModule, example_inputs, inductor_config: dict[str, Any] | None):
    """Inductor's own compile of the step (what ``torch.compile(model)`` runs: its decompositions,
    its partitioner, its fusions and reorders), and the most one run of it, forward and backward,
    holds (its inputs counted), measured; None where it could not be compiled or measured (fxopt's
    plan runs then)."""
    if any(isinstance(t, FakeTensor) for t in example_inputs):
        log.info("fxopt: Inductor's own step is not measured on fake tensors")
        return None
    log.info("fxopt: compiling Inductor's own step to measure it")
    try:
        # (Its backward compiled now, not at its first run: a compile inside the run would be
        # measured, and a compile nested in Dynamo's fails.)
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), _own_choices():
            compiled = compile_fx(gm, example_inputs, config_patches=dict(inductor_config or {}))
        inputs = sum(storages(list(example_inputs)).values())
        return compiled, inputs + _run_increase(compiled, example_inputs)
    except Exception as err:  # noqa: BLE001 - where Inductor's own step fails, fxopt's plan runs
        log.warning("fxopt: Inductor's own step could not be compiled or measured (%s: %s); compiling "
                    "fxopt's plan instead", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None


def _run_increase(compiled: Callable, example_inputs) -> int:
    """The most one forward and backward of ``compiled`` (a Dynamo backend's result) allocates at
    once above what is alive before it, measured (on CPU from the profiler's allocation events, on
    CUDA from the allocator's peak), on the example inputs. The backward is asked of every input
    that requires a gradient (gradients returned, not accumulated into ``.grad``), with a
    gradient of ones for every output that requires one (a loss's backward; an output the loss
    does not reach gets a gradient autograd fills, of the same bytes); inputs the step changes
    (a norm's running statistics) and the random state are put back. Run twice, the second
    measured (a first run may allocate what later ones do not)."""
    inputs = list(example_inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    wrt = [t for t in tensors if t.requires_grad]
    # (Compared, not told by their versions: a kernel that writes into an input bumps none.)
    kept = [(t, t.detach().clone()) for t in tensors if not t.requires_grad]
    device = next((t.device for t in tensors), torch.device("cpu"))

    def run():
        outs = compiled(*inputs)  # (as Dynamo calls it)
        need = [o for o in tensors_in(outs) if o.requires_grad]
        if need and wrt:
            torch.autograd.grad(need, wrt, [torch.ones_like(o) for o in need], allow_unused=True)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type), \
            torch.enable_grad():
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                start = torch.cuda.memory_allocated(device)
                run()
                torch.cuda.synchronize(device)
                increase = torch.cuda.max_memory_allocated(device) - start
            else:
                with profile_cpu_memory(collect=False, every_thread=True) as prof:
                    run()
                increase = peak_increase(allocation_events(prof))
        finally:
            with torch.no_grad():
                for t, value in kept:
                    if not torch.equal(t, value):
                        t.copy_(value)
    return increase


def _uuid() -> bytes:
    return get_hash_for_files(_SOURCES, extra="fxopt")


class _Partitioner(CustomPartitionerFn):
    """fxopt's planner as Inductor's partitioner; the modules it returns are marked and decomposed.
    Where the partition offers Inductor's own step (`OWN_STEP_BOUND`), raises `_OwnStepOffered`
    instead, once; ``offered``: the modules of that offer, returned without planning again.
    ``compiled_held``: what Inductor's own step measured, passed on to the partition once known
    (`CompiledPeakWanted`)."""

    def __init__(self, partition: Callable):
        self.partition = partition
        self.offered: _OwnStepOffered | None = None
        self.compiled_held: int | None | type[CompiledPeakWanted] = CompiledPeakWanted  # (not yet measured)

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        offered, code = self.offered, joint.code  # (before planning, which rewrites the joint graph)
        if offered is not None and offered.joint_code == code:
            fw, bw = offered.fw, offered.bw
        else:
            if self.compiled_held is not CompiledPeakWanted:  # (measured: what the partition asked for)
                kwargs = {**kwargs, "compiled_held": self.compiled_held}
            fw, bw = self.partition(joint, joint_inputs, **kwargs)
            bound = fw.meta.pop(OWN_STEP_BOUND, None)
            if bound is not None and offered is None:
                raise _OwnStepOffered(bound, code, fw, bw)
        held = _held_through_backward(fw, bw, kwargs.get("num_fwd_outputs"))
        table = select_decomp_table()
        fw, bw = decompose(_materialize_in_place(fw), table), decompose(_materialize_in_place(bw), table)
        for node, keep in zip(bw.graph.find_nodes(op="placeholder"), held):
            node.meta[_HELD] = keep  # (read by `_KernelMemory` when Inductor compiles it, maybe late)
        return fw, bw

    def uuid(self) -> bytes:
        return _uuid()

    def __reduce__(self):
        # Inductor pickles its settings into cache keys; the planner (a closure) cannot be pickled
        # and does not change the code Inductor generates for given modules.
        return (bytes, (self.uuid(),))


class _KeepSchedule(InductorChoices):
    """No horizontal fusion; vertical fusion only of kernels adjacent in the schedule: those of
    one op's decomposition, and others where the fused kernel holds no more than the graph's peak
    run kernel by kernel (`_KernelMemory`)."""

    @staticmethod
    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score) -> bool:
        return False

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        if node2.min_order != node1.max_order + 1:
            return False
        if len(_ops_of(node1) | _ops_of(node2)) == 1:
            return True  # the kernels of one op's decomposition: one kernel in the simulator's step
        memory = getattr(scheduler, "_fxopt_memory", None)
        if memory is None:  # (once per graph, from its kernels before any fusion: their orders stay)
            memory = scheduler._fxopt_memory = _KernelMemory(scheduler, _COMPILING_BACKWARD.get())
        return memory.fused_fits(node1.min_order, node2.max_order)

    def uuid(self) -> bytes:
        return _uuid()


# Whether the graph Inductor compiles now is a backward (its inputs, the saved values, are freed
# after their last read; a forward's are the caller's).
_COMPILING_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("fxopt_compiling_backward", default=False)

# The mark on each input of a backward fxopt partitioned: whether it is alive through the whole run
# (`_held_through_backward`). On the graph's own nodes, since Inductor may compile a backward late,
# at its first run.
_HELD = "fxopt_held_through_backward"


def _held_through_backward(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int | None) -> list[bool]:
    """For each input of the backward ``bw``, whether something outside it holds it through its run:
    a parameter or user input (``primals``), an incoming gradient (``tangents``: the autograd engine
    holds them), a forward output (the caller holds it). The rest, the values the forward SAVEd,
    die at their last read (as fxopt's simulator frees them)."""
    outs = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    returned = {o.name for o in outs[:num_fwd_outputs if num_fwd_outputs is not None else len(outs)]
                if isinstance(o, fx.Node)}
    # (By name: in a backward every input that is not a tangent is a "primal" to torch's
    # `partitioners._is_primal`, the saved values too.)
    return [n.name.startswith(("primals", "tangents")) or n.name in returned
            for n in bw.graph.find_nodes(op="placeholder")]


class _KernelMemory:
    """The bytes a graph holds as its kernels run one by one, in their order, each buffer from the
    kernel that writes it to its last reader (a graph output for good; an input of a backward from
    its start to its last reader, a forward's for good, outside this count), and the peak of that.

    Kernels run one by one are what fxopt's simulator predicts. A fused kernel allocates the
    outputs of all its members before it runs and frees their inputs after, so it holds the
    buffers alive before its first member plus every member's outputs: more than either member
    run alone wherever a buffer dies inside it (fusing the kernel that last reads ``x`` with the
    next one keeps ``x`` beside the next one's output; a transformers GPT-2 at its smallest budget
    measured 514 KB over the plan). `fused_fits` allows a fusion where that stays within the
    graph's peak run kernel by kernel, so that fusion never raises the peak the plan predicted.

    That peak is the least the kernels run one by one can hold: Inductor writes a kernel's output
    into an input that dies there (``buf4 = buf2; del buf2  # reuse``), so a kernel may allocate
    nothing, and a peak counted without that was one no run reached: a log-softmax's backward
    written into the nll_loss gradient it reads let the nll_loss backward's last kernel fuse with
    the log-softmax's reduction, over the plan (the test-size transformers Llama, 128 B). So here
    each kernel may reuse, for an output, any buffer or input of the same bytes that dies there
    (`_reusable`: more than Inductor reuses), while what a fused kernel holds counts no reuse: a
    fusion is allowed only where its most stays within that least. A buffer whose size cannot be
    read counts its kernel as unfusable."""

    def __init__(self, scheduler, backward: bool):
        from torch._inductor.virtualized import V

        nodes = scheduler.nodes
        steps = max((n.max_order for n in nodes), default=-1) + 1
        alloc, freed = [0] * steps, [0] * (steps + 1)
        written: list[list[int]] = [[] for _ in range(steps)]  # bytes of each output, by kernel
        dying: list[list[tuple[int, bool]]] = [[] for _ in range(steps + 1)]  # (bytes, freed here), by last reader
        self.unknown = set()
        last: dict[str, int] = {}
        for n in nodes:
            for dep in n.read_writes.reads:
                last[dep.name] = max(last.get(dep.name, -1), n.max_order)
        outputs = set(V.graph.get_output_names())
        for n in nodes:
            for buf in n.get_outputs():
                name = buf.get_name()
                size = _buffer_bytes(buf.node)
                if size is None:
                    self.unknown.add(n.min_order)
                    size = 0
                end = steps if name in outputs else max(last.get(name, n.max_order), n.max_order)
                alloc[n.min_order] += size
                written[n.min_order].append(size)
                if end < steps:
                    freed[end] += size
                    dying[end].append((size, True))
        base = 0
        inputs = V.graph.graph_inputs
        held = _held_marks(V.graph.module) if backward else None
        if backward and held is None:  # (not a backward fxopt partitioned: which inputs die is not known)
            self.unknown.update(range(steps))
        for name, value in inputs.items():
            if name not in last or name in outputs:
                continue  # alive for good, outside this count: it changes no fusion
            size = _buffer_bytes(value)
            dies = backward and name not in (held or ())
            if size is None:
                if dies:  # (freed by a kernel whose fusions then cannot be judged)
                    self.unknown.add(last[name])
                continue
            dying[last[name]].append((size, dies))  # (reusable where it is read last, held or not)
            if dies:
                base += size
                freed[last[name]] += size
        self.before = []
        alive, least, self.peak = base, base, base
        for k in range(steps):
            self.before.append(alive)
            reused, reused_freed = _reusable(written[k], dying[k])
            self.peak = max(self.peak, least + alloc[k] - reused)
            alive += alloc[k] - freed[k]
            least += alloc[k] - reused - (freed[k] - reused_freed)
        self.alloc = alloc

    def fused_fits(self, first: int, last: int) -> bool:
        """Whether the kernels ``first`` to ``last`` (orders), fused, hold no more than the peak.
        (Every buffer they write counts, those only they read too: Inductor may keep such a buffer
        inside the kernel, and did not always where fxopt counted on it, 514 KB over on GPT-2.)"""
        members = range(first, last + 1)
        if any(k in self.unknown for k in members):
            return False
        return self.before[first] + sum(self.alloc[first:last + 1]) <= self.peak


def _held_marks(gm: fx.GraphModule) -> frozenset[str] | None:
    """The inputs of the backward ``gm`` that fxopt's partition marked alive through its run, or
    None where it marked none of them (not a backward fxopt partitioned)."""
    marks = {n.target: n.meta.get(_HELD) for n in gm.graph.find_nodes(op="placeholder")}
    if any(keep is None for keep in marks.values()):
        return None
    return frozenset(name for name, keep in marks.items() if keep)


def _reusable(written: list[int], dying: list[tuple[int, bool]]) -> tuple[int, int]:
    """Of a kernel's outputs (``written``, bytes each), those that may take over the storage of a
    buffer or input dying there (``dying``: bytes, and whether the count frees it there), one
    each, of equal bytes: (their bytes, the bytes of those taken over that the count frees)."""
    free = sorted(dying, reverse=True)
    reused = reused_freed = 0
    for size in sorted(written, reverse=True):
        match = next((i for i, (bytes_, _) in enumerate(free) if bytes_ == size), None)
        if match is None or size == 0:
            continue
        reused += size
        reused_freed += size if free[match][1] else 0
        del free[match]
    return reused, reused_freed


def _ops_of(snode) -> set:
    """The ops (before `fxopt.passes.decompose`) a scheduler node computes part of, the views it
    reads through aside; an unmarked node counts as an op of its own."""
    ops = set()
    for sub in snode.get_nodes():
        origins = [o for o in getattr(sub.node, "origins", None) or () if not _is_view(o)]
        marks = {o.meta.get(OP) for o in origins}
        ops |= marks if marks and None not in marks else {id(sub)}
    return ops


def _is_view(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val._is_view()


def _buffer_bytes(node) -> int | None:
    """Bytes of the storage Inductor allocates for ``node`` (0 for a view or a mutation of another
    buffer, or no tensor); None where it cannot say."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    try:
        layout = node.get_layout()
    except Exception:  # noqa: BLE001 - no layout: no tensor (a multi-output's tuple)
        return 0
    if isinstance(layout, (ir.NoneLayout, ir.MultiOutputLayout, ir.NonOwningLayout)) or "Mutation" in type(layout).__name__:
        return 0
    sizevars = V.graph.sizevars
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint  # (the name before torch 2.13)
    try:
        return int(hint(layout.storage_size())) * layout.dtype.itemsize
    except Exception:  # noqa: BLE001 - an unbacked size, or a layout of another kind
        return None


def _materialize_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Mark every op's own (non-view) output to be written to memory where it is computed."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and not val._is_view():
            node.meta["inductor_realize_to_strides"] = True
    return gm


def _compile_one_kernel_per_call(gm: fx.GraphModule, example_inputs, **kwargs):
    token = _COMPILING_BACKWARD.set(bool(kwargs.get("is_backward", False)))
    try:
        with _flush_each_cpp_kernel(), _own_choices():
            return compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        _COMPILING_BACKWARD.reset(token)


@contextlib.contextmanager
def _own_choices():
    """Inside, Inductor's heuristics (``V.choices``: which kernels fuse) are made anew from the
    settings in force (``inductor_choices_class``: `_KeepSchedule` in fxopt's compiles, Inductor's
    own in Inductor's own step), and after, they are what they were. Inductor makes them once per
    thread, at the thread's first compile, and keeps them: a process whose first compile was a
    plain ``torch.compile`` compiled fxopt's modules with no fusion guard (the bench transformers
    Llama at HF checkpointing's peak: 44.65 MiB against a 42.30 MiB budget, within it alone), and
    one whose first compile was fxopt's compiled later plain ones under fxopt's guard."""
    from torch._inductor import virtualized

    local, key = virtualized.threadlocal, getattr(virtualized._choices, "_key", None)
    if key is None:  # pragma: no cover - another torch: no per-thread heuristics to reset
        log.warning("fxopt: this torch keeps Inductor's heuristics elsewhere; a compile may use another's")
        yield
        return
    had, prior = hasattr(local, key), getattr(local, key, None)
    if had:
        delattr(local, key)
    try:
        yield
    finally:
        if had:
            setattr(local, key, prior)
        elif hasattr(local, key):
            delattr(local, key)


@contextlib.contextmanager
def _flush_each_cpp_kernel():
    """The C++ backend flushes its kernel group when the group's arguments exceed
    ``MAX_FUSED_KERNEL_ARGS_NUM``; at 0 every kernel is its own call, allocated when it runs."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
    except ImportError:  # pragma: no cover - an Inductor without its C++ backend
        yield
        return
    if not hasattr(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM"):  # pragma: no cover - another torch
        log.warning("fxopt: this torch's C++ backend groups kernels; Inductor's peak may exceed the plan's")
        yield
        return
    saved = CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = 0
    try:
        yield
    finally:
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = saved
