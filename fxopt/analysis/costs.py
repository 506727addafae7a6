"""What a node costs: counted FLOPs (``torch.utils.flop_counter``'s formulas) and estimated
seconds (`CostModel`: FLOPs, plus memory traffic, plus a per-op overhead; optionally, a pointwise
op priced as fused into the kernel that reads it, its FLOPs only)."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from fxopt.devices import DeviceProfile


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one node: FLOPs / ``flops_per_second`` + bytes read and written /
    ``bytes_per_second`` + bytes sent over a process group (an all-gather's) /
    ``comm_bytes_per_second`` + ``op_overhead`` seconds. Only ratios matter to the solvers. The
    defaults are a rough 2-core CPU; on GPU the same ratios order plans sensibly.
    ``comm_bytes_per_second`` None: the process group's backend's rate (`COMM_BYTES_PER_SECOND`).

    ``fused_pointwise``: price a pointwise op (`Node.op_class` "pointwise") as fused into the
    kernel that reads it: its FLOPs at ``flops_per_second`` and a tenth of ``op_overhead`` (as a
    view), no memory traffic. Off by default, with either compiler: fxopt's Inductor compile
    writes every value the simulator counts to memory (`fxopt.capture.inductor`), a recomputed
    pointwise op too, so it moves its bytes as op by op; measured at HF checkpointing's peak on
    GPT-2, Llama and ViT, plans made with it were not faster beyond the noise, and on GPT-2 at
    half of Inductor's activations the lowest-peak search found no plan within a budget it meets
    without it (docs/benchmarks.md). Reductions (a layer norm, a softmax, a sum) keep their full price
    either way: Inductor runs each as a kernel of its own that reads its input from memory.

    ``overlap_regathers``: price a re-gather (an all-gather the backward runs again, FSDP's
    reshard after forward) by the time the step waits for it, not its whole communication time:
    the rewritten step issues it ahead of its wait, behind the backward's compute
    (`fxopt.solvers.prefetch`), and the simulator counts the gathered buffer from that issue and
    the wait that is left (`fxopt.solvers.schedule.Timeline.exposed_comm_seconds`). Off: its whole
    communication is on the step's path, as when each re-gather was waited for where it was issued."""

    flops_per_second: float = 1e11
    bytes_per_second: float = 1e10
    op_overhead: float = 2e-6
    comm_bytes_per_second: float | None = None
    fused_pointwise: bool = False
    overlap_regathers: bool = True

    def seconds(self, flops: int, bytes_moved: int, is_alias: bool, comm_bytes: int = 0,
                pointwise: bool = False) -> float:
        if is_alias:
            return self.op_overhead / 10
        if pointwise and self.fused_pointwise:
            return flops / self.flops_per_second + self.op_overhead / 10
        comm = self.comm_seconds(comm_bytes)
        return flops / self.flops_per_second + bytes_moved / self.bytes_per_second + comm + self.op_overhead

    def comm_seconds(self, comm_bytes: int) -> float:
        """Seconds a collective that moves ``comm_bytes`` to this rank occupies the process group."""
        return comm_bytes / (self.comm_bytes_per_second or COMM_BYTES_PER_SECOND["gloo"]) if comm_bytes else 0.0

    @classmethod
    def for_device(cls, profile: DeviceProfile, dtype: torch.dtype) -> CostModel:
        """The rates of a device profile (`fxopt.devices`) for a step whose floating-point math is
        mostly in ``dtype``: its FLOP rate for that dtype (float32's where it states none), its
        memory bandwidth, its interconnect for collectives."""
        rates = profile.flops_per_second
        name = str(dtype).removeprefix("torch.")
        return cls(flops_per_second=rates.get(name, rates["float32"]),
                   bytes_per_second=profile.memory_bandwidth_bytes_per_second,
                   comm_bytes_per_second=profile.interconnect_bytes_per_second)

    def for_group(self, backend: str | None) -> CostModel:
        """This model with the communication rate of a process group of ``backend`` filled in."""
        if self.comm_bytes_per_second is not None or backend is None:
            return self
        rate = COMM_BYTES_PER_SECOND.get(backend, COMM_BYTES_PER_SECOND["gloo"])
        return dataclasses.replace(self, comm_bytes_per_second=rate)


# Bytes per second an all-gather moves per rank, by process-group backend: gloo over loopback TCP
# (CPU), NCCL within a node (NVLink-class; PCIe is about 10x less). Rough: only ratios to the
# compute rates matter, and a user who knows the link sets ``comm_bytes_per_second``.
COMM_BYTES_PER_SECOND = {"gloo": 1e9, "nccl": 1e11}

# The collectives whose output is a pure function of every rank's input (recomputing one is
# communicating again), and the wait that makes their output readable.
GATHERS = ("all_gather_into_tensor",)
WAITS = ("wait_tensor",)
# The all-reduces (DDP's gradients in the graph, `fxopt.distributed.ddp`; in place on a bucket,
# `fxopt.passes.coalesce`): never recomputed, as every other collective but the gathers.
REDUCES = ("all_reduce", "all_reduce_")
# The reduce-scatters (FSDP's gradients, `fxopt.distributed.fsdp`): each rank receives (n - 1)
# pieces of its shard's size, as a ring sends them.
SCATTERS = ("reduce_scatter_tensor",)


def comm_bytes_of(node: fx.Node) -> int:
    """Bytes this rank receives to make ``node``: an all-gather's output less its own share; for
    an all-reduce over n ranks, a ring's 2 (n - 1) / n of its output (reduce-scatter, then
    all-gather); for a reduce-scatter, n - 1 times its output (its shard)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
        return 0
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    nbytes = val.numel() * val.element_size()
    if target._opname in REDUCES:
        size = group_size(node)
        return 2 * (nbytes - nbytes // size) if size > 1 else 0
    if target._opname in SCATTERS:
        size = node.args[2] if len(node.args) > 2 else 1
        return nbytes * (size - 1) if isinstance(size, int) and size > 1 else 0
    if target._opname not in GATHERS:
        return 0
    size = node.args[1] if len(node.args) > 1 else 1
    if not isinstance(size, int):
        return 0
    return nbytes - nbytes // max(1, size)


def group_size(node: fx.Node) -> int:
    """The number of ranks of the process group a functional collective names (1 when unknown)."""
    name = node.args[-1] if node.args else None
    if not isinstance(name, str):
        return 1
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name).size())
    except Exception:  # noqa: BLE001 - a group not in this process (a replayed graph): unknown
        return 1


def group_backend(node: fx.Node) -> str | None:
    """The backend ("gloo", "nccl") of the process group a functional collective names."""
    name = node.args[-1] if node.args else None
    if not isinstance(name, str):
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return str(torch.distributed.get_backend(_resolve_process_group(name)))
    except Exception:  # noqa: BLE001 - a group not in this process (a replayed graph): the default
        return None


def flops_of(node: fx.Node) -> int | torch.SymInt | None:
    """FLOPs of ``node`` as ``torch.utils.flop_counter`` counts them (0 for ops it has no formula
    for, as FlopCounterMode counts them; a ``SymInt`` on symbolic shapes), or None when its
    formula does not fit the arguments: then the cost is unknown, and the node is not offered for
    recomputation."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    try:
        flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    except Exception:  # noqa: BLE001 - a formula that does not fit these arguments: cost unknown
        return None
    return flops if isinstance(flops, torch.SymInt) else int(flops)
