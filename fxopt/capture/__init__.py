"""Capture: Dynamo and AOTAutograd glue, the only place fxopt meets torch.compile.

  - `dynamo`: the torch.compile backend fxopt builds on (the partitioner hook that plans and
    rewrites; Dynamo's logging switches; unread resident bytes).
  - `pieces`: a step Dynamo splits at graph breaks, planned piece by piece.
  - `backend`: the public ``torch.compile(model, backend="fxopt")`` backend (`fxopt.backend`).
  - `inductor`: the rewritten forward and backward compiled by Inductor.
"""
