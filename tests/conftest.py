import os
import warnings

import pytest
import torch

# Cases of parametrized tests that take about 3 s or more on 2 quiet cores (`pytest -m "not slow"
# --durations=80` at 4f67ab8 quiet, and 3.8 s or more under load 2-4): in the full suite only,
# marked slow below, so the fast subset for development (`-m "not slow"`) stays under 5 minutes.
# Whole tests that slow carry `@pytest.mark.slow` themselves. Each entry must name a case that
# exists (checked at collection).
SLOW_CASES = {
    "test_zoo.py::test_budget_and_parity": ("cnn_bn-0.4", "cnn_bn-0.6", "gpt2_tiny-0.4", "gpt2_tiny-0.6",
                                             "gpt2_tiny-1.0", "inplace_net-0.4", "inplace_net-0.6",
                                             "residual_mlp-0.4", "residual_mlp-0.6", "transformer_block-0.4",
                                             "transformer_block-0.6"),
    "test_zoo.py::test_recompute_lowers_peak": ("cnn_bn", "gpt2_tiny", "inplace_net", "residual_mlp", "tied_lm",
                                                 "transformer_block"),
    "test_blocks.py::test_at_the_smallest_budget_the_plan_costs_what_the_whole_graphs_does": ("256-True",),
    "test_blocks.py::test_the_smallest_budget_through_the_blocks_is_the_whole_graphs": ("256-False", "64-False",
                                                                                         "64-True"),
    "test_devices.py::test_every_zoo_model_plans_for_an_h100": ("gpt2_tiny", "residual_mlp", "transformer_block"),
    "test_devices.py::test_the_fake_tensor_plan_is_the_real_tensor_plan": ("cnn_bn", "gpt2_tiny", "residual_mlp",
                                                                           "transformer_block"),
    "test_devices.py::test_the_h100_plan_is_the_host_plan_rounded_with_the_workspace": ("inplace_net",
                                                                                         "transformer_block"),
    "test_pipeline.py::test_min_plans_at_the_smallest_budget_an_infeasible_one_names": ("None", "split_points1"),
    "test_offload_runtime.py::test_offload_everything_is_bit_identical": ("cnn_bn", "gpt2_tiny", "residual_mlp"),
    "test_solvers.py::test_the_plan_does_not_depend_on_how_fast_the_clock_runs": ("0.6",),
    "test_offload_runtime.py::test_offload_with_compression_is_bit_identical": ("cnn_bn", "gpt2_tiny"),
}


# Workers `-n auto` starts (pyproject's addopts): one per core this process may run on, at most
# this many. Each holds torch, transformers and its file's models (1-3 GiB), and the tests of
# several ranks spawn 2-4 processes more.
MOST_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`pytest-xdist`'s ``-n auto``: the cores this process may run on, at most `MOST_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MOST_WORKERS))

def pytest_collection_modifyitems(config, items):
    """Marks `SLOW_CASES` slow (before ``-m`` deselects), and refuses an entry naming no case of a
    test collected here (a renamed test or case would otherwise silently join the fast subset)."""
    seen: dict[str, set[str]] = {}
    for item in items:
        test = item.nodeid.split("/")[-1].split("[")[0]
        case = getattr(getattr(item, "callspec", None), "id", None)
        seen.setdefault(test, set()).add(case)
        if case in SLOW_CASES.get(test, ()):
            item.add_marker(pytest.mark.slow)
    for test, cases in SLOW_CASES.items():
        if test in seen and not set(cases) <= seen[test]:
            raise pytest.UsageError(f"tests/conftest.py SLOW_CASES names cases of {test} that do not exist: "
                                    f"{sorted(set(cases) - seen[test])} (its cases: {sorted(map(str, seen[test]))})")


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
