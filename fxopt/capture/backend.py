"""fxopt as a torch.compile backend.

    torch.compile(model, backend="fxopt", options={"budget": "2GiB"})           # no import needed
    torch.compile(model, backend=fxopt.backend(budget=0.5, compiler="eager"))   # or configured

The name ``"fxopt"`` is registered in the ``torch_dynamo_backends`` entry-point group (see
pyproject.toml), which Dynamo reads when it meets a backend name it does not know; it calls
`fxopt_backend` with ``options=`` as given to torch.compile.

Graph breaks: Dynamo, unlike ``fullgraph=True``, splits a model it cannot trace whole into
several graphs with Python in between, and hands each to the backend alone. Each piece's plan
bounds only that piece, and what earlier pieces saved for their backward is still alive while
later pieces run, so the step's peak could exceed the budget. The backend sees only the pieces,
not the model, so it cannot count what the rest of the step holds (`fxopt.optimize` can: see
`fxopt.capture.pieces`). By default the backend refuses a graph break, naming where it is;
``graph_breaks="warn"`` plans each piece against the budget on its own and warns that the step
as a whole is not bounded.

Logging and printing inside ``forward()`` are not graph breaks here either (HF's loss path logs
with ``logger.warning_once``): as for `fxopt.optimize`, ``print`` and ``warnings.warn`` run after
the graph and ``logging.Logger`` calls are skipped inside compiled code. torch.compile gives a
backend no context around the calls it compiles, so these switches of Dynamo's are turned on for
the rest of the process, every compiled region's, as soon as the backend is made
(`fxopt.backend`) or looked up by name (``backend="fxopt"``, through `fxopt.capture.entry`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxopt.budget import BudgetLike
from fxopt.capture.dynamo import install_logging_switches, make_backend
from fxopt.capture.pieces import GraphBreakWarning, break_location
from fxopt.errors import CaptureError, check_choice
from fxopt.options import Options, check_names
from fxopt.solvers.plan import Plan

log = logging.getLogger("fxopt")

GRAPH_BREAKS = ("error", "warn")


class FxoptBackend:
    """A torch.compile backend that plans and rewrites each captured training step. ``plans``
    holds every plan it made, in the order the graphs were compiled."""

    def __init__(self, options: Options, graph_breaks: str = "error"):
        check_choice("graph_breaks", graph_breaks, GRAPH_BREAKS)
        install_logging_switches()  # before Dynamo traces (see the module docstring)
        self.options = options
        self.graph_breaks = graph_breaks
        self.plans: list[Plan] = []
        self._compile = make_backend(options, self.plans.append)
        # A piece that a graph break ends: later pieces differentiate its outputs.
        self._compile_piece = make_backend(options, self.plans.append, whole_step=False)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        _refuse_dynamic_shapes(example_inputs)
        piece = self._check_graph_break(gm)
        return (self._compile_piece if piece else self._compile)(gm, example_inputs)

    def _check_graph_break(self, gm: fx.GraphModule) -> bool:
        """Whether a graph break ends ``gm`` (raising where graph breaks are refused)."""
        where = break_location(gm)
        if where is None:
            return False
        if self.graph_breaks == "error":
            raise CaptureError(
                f"torch.compile split this training step at a graph break at {where}; fxopt can "
                "only bound the peak of a step it sees whole. Remove the break (run once with "
                "torch.compile(..., fullgraph=True) to see it; data-dependent Python such as .item() "
                "or printing is the usual cause), or pass options={'graph_breaks': 'warn'} to plan "
                "each piece on its own, with no bound on the whole step."
            )
        message = (
            f"torch.compile split this training step at a graph break at {where}; fxopt plans "
            "each piece against the budget on its own, so the step's peak is not bounded: what "
            "earlier pieces save for the backward adds to later pieces' peaks."
        )
        log.warning("fxopt: %s", message)
        warnings.warn(message, GraphBreakWarning, stacklevel=2)
        return True


def backend(budget: BudgetLike | Options, *, graph_breaks: str = "error", **options: Any) -> FxoptBackend:
    """A backend for ``torch.compile(model, backend=fxopt.backend(...))``.

    ``budget``, ``options``: as for `fxopt.optimize` (the fields of `fxopt.Options`; a share
    budget is of the captured step's eager peak), except that ``compiler`` is ``"inductor"``
    unless given (fused kernels, see `fxopt.capture.inductor`). ``graph_breaks``: ``"error"``
    (default) or ``"warn"``, see the module docstring.
    """
    return FxoptBackend(Options.of(budget, defaults={"compiler": "inductor"}, **options), graph_breaks)


def fxopt_backend(gm: fx.GraphModule, example_inputs, *, options: dict[str, Any] | None = None,
                  mode: str | None = None) -> Callable:
    """The ``torch_dynamo_backends`` entry point ``fxopt``: ``torch.compile(model,
    backend="fxopt", options={"budget": ..., ...})``. The options are `backend`'s arguments,
    with ``inductor`` for ``inductor_config``."""
    if mode not in (None, "default"):
        raise ValueError(f"the fxopt backend takes no mode (got {mode!r}); pass Inductor settings "
                         "as options={'budget': ..., 'inductor': {...}}")
    options = dict(options or {})
    check_names(options, besides=("graph_breaks", "inductor"))
    if "budget" not in options:
        raise ValueError("the fxopt backend needs a budget: torch.compile(model, backend='fxopt', "
                         "options={'budget': '2GiB'}) (bytes, '3GiB', '500MB', '50%', 0.5 or 'min')")
    if "inductor" in options:
        options["inductor_config"] = options.pop("inductor")
    return backend(**options)(gm, example_inputs)


def _refuse_dynamic_shapes(example_inputs) -> None:
    for value in example_inputs:
        if isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)
        ):
            raise CaptureError(
                "the fxopt backend plans static shapes, and Dynamo is compiling this step with dynamic "
                "ones (it does when it sees a second shape). Compile with torch.compile(model, "
                "backend='fxopt', dynamic=False, ...): each new shape is then planned on its own; or "
                "use fxopt.optimize(model, budget, dynamic={'batch': (lo, hi), ...}) for one plan over "
                "a range of shapes."
            )
