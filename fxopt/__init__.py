"""fxopt: budgeted rematerialization of the whole PyTorch training step.

    model = fxopt.optimize(model, "2GiB")        # the budget you give is the peak you get
    plan = fxopt.plan(model, 0.5, (x,))          # inspect before running
    print(fxopt.fit(model, (x,), device="H100-80GB"))   # does it fit a GPU, planned on this machine
    model = fxopt.optimize(model, "min")         # the smallest budget fxopt can meet
    options = fxopt.Options(budget="2GiB", solver="ilp")   # how to plan, for every entry point
    torch.compile(model, backend="fxopt", options={"budget": "2GiB"})   # or fxopt.backend(...)

The names below are imported on first use (PEP 562), so that ``import fxopt.solvers`` and
``fxopt.errors`` do not import torch.
"""

from __future__ import annotations

import importlib

from fxopt._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "optimize": "fxopt.api",
    "plan": "fxopt.api",
    "Options": "fxopt.options",
    "max_batch": "fxopt.maxbatch",
    "MaxBatch": "fxopt.maxbatch",
    "fit": "fxopt.fitting",
    "Fit": "fxopt.fitting",
    "FxoptModule": "fxopt.api",
    "backend": "fxopt.capture.backend",
    "Plan": "fxopt.solvers.plan",
    "pipeline": "fxopt.distributed.pipeline",
    "PipelinePlan": "fxopt.solvers.stage_plan",
    "Quantize": "fxopt.analysis.codecs",
    "gradient_sqnr": "fxopt.measure",
    "measure_peak": "fxopt.measure",
    "PeakMemory": "fxopt.measure",
    "InfeasibleBudgetError": "fxopt.errors",
    "CaptureError": "fxopt.errors",
    "BudgetError": "fxopt.errors",
    "FxoptError": "fxopt.errors",
    "GraphBreakWarning": "fxopt.capture.pieces",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fxopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
