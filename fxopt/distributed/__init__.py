"""fxopt on several processes: torch.distributed does the communication, fxopt the planning.

  - `fxopt.distributed.pipeline`: pipeline stages: fxopt chooses the cuts and plans each stage;
    torch.distributed.pipelining runs them.
"""
