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


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone (world size 1), for the tests of sharding and
    DDP that need one without spawning ranks (`data_parallel_steps.free_port` picks its port)."""
    import torch.distributed as dist
    from data_parallel_steps import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
