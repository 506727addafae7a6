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


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    """Tests solve every time; the one test of the cache turns it on in a temporary directory."""
    monkeypatch.setenv("FXOPT_CACHE", "0")


@pytest.fixture(autouse=True)
def _fresh_lowest_peaks():
    """The planner's memo of lowest-peak schedules (`fxopt.cache.lowest_peaks`) starts empty in
    every test: it only saves time (a hit is what the search finds again), so no test may pass
    because of what another solved before it."""
    from fxopt import cache

    cache.lowest_peaks.clear()
    yield
    cache.lowest_peaks.clear()
