import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models; keep Dynamo's caches from one test out of the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _quiet_timeouts():
    from fxopt.solvers import SolverTimeoutWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        yield
