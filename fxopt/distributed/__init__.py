"""fxopt on several processes: `data_parallel` (DDP and FSDP2), `ddp` (DDP's gradient
all-reduces in fxopt's graph), `fsdp2` (FSDP2's models planned as one graph), `fsdp` (fully sharded data parallel as one graph: `fully_shard`) and `pipeline` (pipeline stages: fxopt chooses the cuts and
plans each stage). Process groups, sharding, pipelining and communication are torch.distributed's;
these modules say what it adds to each rank's peak."""

from fxopt.distributed.fsdp import fully_shard

__all__ = ["fully_shard"]
