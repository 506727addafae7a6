"""fxopt on several processes: `data_parallel` (DDP and FSDP2) and `pipeline` (pipeline stages:
fxopt chooses the cuts and plans each stage). Process groups, sharding, pipelining and
communication are torch.distributed's; these modules say what it adds to each rank's peak."""
