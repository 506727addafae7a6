"""What a node costs: counted FLOPs (``torch.utils.flop_counter``'s formulas) and estimated
seconds (`CostModel`: FLOPs, plus memory traffic, plus a per-op overhead)."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one node: FLOPs / ``flops_per_second`` + bytes read and written /
    ``bytes_per_second`` + ``op_overhead`` seconds. Only ratios matter to the solvers. The
    defaults are a rough 2-core CPU; on GPU the same ratios order plans sensibly."""

    flops_per_second: float = 1e11
    bytes_per_second: float = 1e10
    op_overhead: float = 2e-6

    def seconds(self, flops: int, bytes_moved: int, is_alias: bool) -> float:
        if is_alias:
            return self.op_overhead / 10
        return flops / self.flops_per_second + bytes_moved / self.bytes_per_second + self.op_overhead


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
