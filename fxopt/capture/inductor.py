"""Compile fxopt's forward and backward with Inductor without losing the plan.

Inductor's own pipeline runs as for any torch.compile (``compile_fx``), with fxopt's planner as its
partitioner (``custom_partitioner_fn``): Inductor does not choose what to save or recompute. The
saved tensors are the forward's outputs fxopt chose, and the backward reads exactly those.

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
  adjacent in the schedule.
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

from fxopt.passes.decompose import decompose

log = logging.getLogger("fxopt")

_PACKAGE = Path(__file__).parent.parent
_SOURCES = tuple(str(_PACKAGE / name) for name in ("capture/inductor.py", "passes/decompose.py"))


def inductor_backend(partition: Callable, inductor_config: dict[str, Any] | None = None) -> Callable:
    """A torch.compile backend: Inductor, with ``partition(joint, joint_inputs, *,
    num_fwd_outputs, **kw) -> (fw, bw)`` as its partitioner and the settings above.
    ``inductor_config``: more Inductor settings, applied last."""
    patches = {
        "custom_partitioner_fn": _Partitioner(partition),
        "inductor_choices_class": _KeepSchedule,
        "reorder_for_peak_memory": False,
        "allow_buffer_reuse": False,
        "fallback_random": True,
        "layout_optimization": False,
        **(inductor_config or {}),
    }

    def compile_inductor(gm: fx.GraphModule, example_inputs):
        log.info("fxopt: compiling the planned step with Inductor")
        # AOTAutograd's cache would hand back an earlier compile without calling the partitioner:
        # no plan, and not necessarily this budget's. (Inductor's cache of each module stays on.)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=_compile_one_kernel_per_call,
                              config_patches=patches, decompositions={})

    return compile_inductor


def _uuid() -> bytes:
    return get_hash_for_files(_SOURCES, extra="fxopt")


class _Partitioner(CustomPartitionerFn):
    """fxopt's planner as Inductor's partitioner; the modules it returns are marked and decomposed."""

    def __init__(self, partition: Callable):
        self.partition = partition

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        fw, bw = self.partition(joint, joint_inputs, **kwargs)
        table = select_decomp_table()
        return decompose(_materialize_in_place(fw), table), decompose(_materialize_in_place(bw), table)

    def uuid(self) -> bytes:
        return _uuid()

    def __reduce__(self):
        # Inductor pickles its settings into cache keys; the planner (a closure) cannot be pickled
        # and does not change the code Inductor generates for given modules.
        return (bytes, (self.uuid(),))


class _KeepSchedule(InductorChoices):
    """No horizontal fusion; vertical fusion only of kernels adjacent in the schedule."""

    @staticmethod
    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score) -> bool:
        return False

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        return node2.min_order == node1.max_order + 1

    def uuid(self) -> bytes:
        return _uuid()


def _materialize_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Mark every op's own (non-view) output to be written to memory where it is computed."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and not val._is_view():
            node.meta["inductor_realize_to_strides"] = True
    return gm


def _compile_one_kernel_per_call(gm: fx.GraphModule, example_inputs, **kwargs):
    with _flush_each_cpp_kernel():
        return compile_fx_inner(gm, example_inputs, **kwargs)


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
