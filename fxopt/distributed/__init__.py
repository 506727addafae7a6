"""fxopt on several processes: `data_parallel` (DDP and FSDP2). Process groups, sharding and
communication are torch.distributed's; these modules say what it adds to each rank's peak."""
