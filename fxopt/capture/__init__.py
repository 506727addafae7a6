"""Capture: Dynamo and AOTAutograd glue, the only place fxopt meets torch.compile.

  - `dynamo`: the one backend factory (`step_backend`: AOTAutograd with fxopt's partitioner, run by
    the eager or the Inductor compiler), the planning partitioner (`make_backend`), Dynamo's
    logging switches, unread resident bytes.
  - `compiled`: compiling a step entered through a code object of its own, and running it (Dynamo's
    settings, dispatch modes, errors).
  - `coverage`: the check after each call that the graphs fxopt planned covered the step.
  - `pieces`: a step Dynamo splits at graph breaks, planned piece by piece.
  - `dynamic`, `shapes`: a step captured for a range of shapes.
  - `backend`, `entry`: the public ``torch.compile(model, backend="fxopt")`` backend (`fxopt.backend`).
  - `inductor`: the rewritten forward and backward compiled by Inductor.
"""
