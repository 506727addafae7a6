"""fxopt: budgeted rematerialization of the whole PyTorch training step.

    model = fxopt.optimize(model, "2GiB")        # the budget you give is the peak you get
    plan = fxopt.plan(model, 0.5, (x,))          # inspect before running
    torch.compile(model, backend="fxopt", options={"budget": "2GiB"})   # or fxopt.backend(...)
"""

from fxopt.api import FxoptModule, optimize, plan
from fxopt.compression import Quantize, gradient_sqnr
from fxopt.dynamo_backend import backend
from fxopt.errors import BudgetError, CaptureError, FxoptError, InfeasibleBudgetError
from fxopt.measure import PeakMemory, measure_peak
from fxopt.pieces import GraphBreakWarning
from fxopt.plan import Plan

__all__ = [
    "optimize",
    "plan",
    "backend",
    "Plan",
    "Quantize",
    "gradient_sqnr",
    "FxoptModule",
    "measure_peak",
    "PeakMemory",
    "InfeasibleBudgetError",
    "CaptureError",
    "BudgetError",
    "FxoptError",
    "GraphBreakWarning",
]
__version__ = "0.1.0"
