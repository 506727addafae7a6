"""Capture the training step for the planner: the torch.compile backend fxopt builds on.

Dynamo captures the model's forward as a graph. AOTAutograd traces forward and backward into one
aten-level joint graph, without decompositions, so random ops stay whole and run exactly once,
in eager order: dropout masks are eager's. Its partitioner hook (``partition_fn``) is where fxopt
plans (`fxopt.planner`) and rewrites (`fxopt.passes.recompute`). The forward and backward run as
FX Python code taking their inputs boxed (or through Inductor, `fxopt.capture.inductor`), so
saved tensors are released as soon as the backward has used them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from fxopt.capture.opcalls import DirectOpCodeGen
from fxopt.fxgraph import copy_module
from fxopt.measuring import not_measured, step_runs
from fxopt.passes.recompute import split_with_recompute
from fxopt.solvers.plan import Plan
from fxopt.planner import Analyses, Options, make_plan
from fxopt.storage import storages, tensors_in

log = logging.getLogger("fxopt")

# Logging inside forward() (HF's ``logger.warning_once`` in its loss path, say) is a graph break.
# Dynamo can move ``print`` and ``warnings.warn`` calls to after the graph, so they still run;
# a Logger method it can only skip: those are not emitted while the compiled step runs.
_REORDERABLE = (print, warnings.warn)
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def _logger_methods() -> set:
    """Every logging method of the Logger classes in use, including those libraries add
    (``transformers`` adds ``warning_once`` and ``info_once`` to ``logging.Logger``)."""
    methods = set()
    for cls in {logging.Logger, logging.getLoggerClass()}:
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                if callable(value) and (name in _LOGGER_METHODS or name.endswith("_once") or name.startswith("warning_")):
                    methods.add(value)
    return methods


def _switched_on() -> dict:
    cfg = torch._dynamo.config
    return {"reorderable_logging_functions": set(cfg.reorderable_logging_functions) | set(_REORDERABLE),
            "ignore_logger_methods": set(cfg.ignore_logger_methods) | _logger_methods()}


def _compile_metrics_bear_the_switches() -> None:
    """Where torch's compile-metrics logging cannot write Dynamo's config with the switches on, it
    leaves the config out instead. Every compile ends by writing Dynamo's config as JSON, each set
    sorted, except settings it names; torch 2.11 names ``ignore_logger_methods`` but not
    ``ignore_logging_functions``, the setting it has been an alias of since, so sorting Logger
    methods raised, and each compile logged "Unexpected exception logging compilation metrics"
    with a traceback (torch 2.12 names both). Checked, not assumed from the version: once per
    process, the answer marked on torch's function (the check writes Dynamo's whole config as
    JSON, 1.6 ms, and a step runs this at every call: `fxopt.capture.compiled.dynamo_settings`)."""
    utils = torch._dynamo.utils
    original = getattr(utils, "_get_dynamo_config_for_logging", None)
    if original is None or getattr(original, "fxopt_bears_the_switches", False):
        return
    try:
        with torch._dynamo.config.patch(**_switched_on()):
            original()
        original.fxopt_bears_the_switches = True  # (it bears them as it is)
        return
    except TypeError:
        pass

    @functools.wraps(original)
    def config_for_logging():
        try:
            return original()
        except TypeError:
            return None  # (what it gives where there is no config to log)

    config_for_logging.fxopt_bears_the_switches = True
    utils._get_dynamo_config_for_logging = config_for_logging


def logging_switches(**more):
    """Dynamo's logging switches for the duration of a capture (see above), with ``more`` of
    Dynamo's settings in the same patch."""
    _compile_metrics_bear_the_switches()
    return torch._dynamo.config.patch(**_switched_on(), **more)


def install_logging_switches() -> None:
    """Dynamo's logging switches, on from now on in this process. What the backend route needs: a
    backend given to torch.compile is first called once Dynamo has traced a frame (and broken it
    at a logging call), and torch.compile gives it no context around the calls it compiles; so
    the backend turns them on when it is made or looked up (`fxopt.capture.backend`)."""
    _compile_metrics_bear_the_switches()
    for name, value in _switched_on().items():
        setattr(torch._dynamo.config, name, value)


class Answered(Exception):
    """Raised from the partitioner to stop after answering questions about one captured step
    (`make_backend`'s ``ask``): ``answer``, what ``ask`` returned."""

    def __init__(self, answer):
        super().__init__("answered")
        self.answer = answer


class PlanReady(Exception):
    """Raised from the partitioner to stop after planning (`fxopt.plan` does not run the model).
    ``forward`` and ``backward``: the rewritten modules, before any compiler (or ``split``, which
    makes them when first asked for: `fxopt.plan` reads the plan alone, and at 32 layers splitting
    the joint graph into its two modules took most of a second); ``joint``: the analysed joint
    graph (`fxopt.analysis.JointGraph`) the plan was made on."""

    def __init__(self, plan: Plan, forward: fx.GraphModule | None = None, backward: fx.GraphModule | None = None,
                 joint=None, *, split: Callable[[], tuple[fx.GraphModule, fx.GraphModule]] | None = None):
        super().__init__("plan ready")
        self.plan = plan
        self._modules = (forward, backward)
        self._split = split
        self.joint = joint

    @property
    def forward(self) -> fx.GraphModule | None:
        return self._split_modules()[0]

    @property
    def backward(self) -> fx.GraphModule | None:
        return self._split_modules()[1]

    def _split_modules(self) -> tuple:
        if self._split is not None:
            self._modules, self._split = self._split(), None
        return self._modules


@dataclasses.dataclass(frozen=True)
class CapturedStep:
    """A step captured and not yet planned (`make_backend`'s ``ask``): its joint graph, as
    `make_plan` takes it, and the graph's example inputs (Dynamo's: parameters and inputs)."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    unread_bytes: int
    inputs: list
    backward_bytes: int = 0

    def plan(self, options: Options, analyses: Analyses | None = None, *, copy: bool = True) -> PlanReady:
        """A copy of the step planned for ``options`` (`InfeasibleBudgetError` where nothing fits).
        ``analyses``: the step's copies analysed for the plans before this one (`make_plan`).
        ``copy`` False: the step's own graph planned (rewritten in place), where it is planned once
        (as `make_backend` plans a step it captured; a copy of a 32-layer step took 0.3 s)."""
        jg, plan = make_plan(copy_module(self.joint) if copy else self.joint, self.num_fwd_outputs, options,
                             self.unread_bytes, backward_bytes=self.backward_bytes, analyses=analyses)
        return PlanReady(plan, joint=jg, split=lambda: split_with_recompute(jg, plan.schedule))


def _boxed(gm: fx.GraphModule, example_inputs) -> Callable:
    """Run `gm` as FX Python code that takes its inputs as a list and clears it, so each input
    (a saved activation, a tangent) is freed after its last use, like every intermediate. An
    incoming gradient that autograd left undefined (None: see `unreached_gradients_stay_undefined`)
    is given as zeros that hold one element, expanded to its shape: the same values, and no
    storage the size of the output it is the gradient of. Each op is called through its builtin
    (`fxopt.capture.opcalls`: the same results, less Python per op)."""
    if DirectOpCodeGen is not None:
        gm.graph.set_codegen(DirectOpCodeGen())
        gm.recompile()

        def call(args):
            return gm(args)
    else:  # older torch: the interpreter also frees values after their last use
        def call(args):
            return fx.Interpreter(gm).boxed_run(args)

    zeros = {k: v for k, n in enumerate(gm.graph.find_nodes(op="placeholder"))
             if n.name.startswith("tangents") and isinstance(v := n.meta.get("val"), torch.Tensor)}

    def run(args):
        for k, v in zeros.items():
            if k < len(args) and args[k] is None:
                args[k] = torch.zeros((), dtype=v.dtype, device=v.device).expand(v.shape)
        return call(args)

    run._boxed_call = True
    return run


def unreached_gradients_stay_undefined(outputs) -> None:
    """Let autograd pass None, not zeros, to the backward of a graph compiled by `eager_backend`
    for those of its outputs the loss does not reach. By default an autograd function gets a
    zero-filled gradient for each output that needs one and got none (``materialize_grads``), so
    a step that returns the logits beside the loss computed from them (a transformers LM given
    labels) would allocate a gradient the size of the logits that eager autograd never makes;
    AOTAutograd turns that off only for outputs that need no gradient. `_boxed` makes the zeros
    without that storage. (A graph compiled by Inductor expects real tensors: not for those.)"""
    for node in {id(t.grad_fn): t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None}.values():
        if type(node).__name__ == "CompiledFunctionBackward" and hasattr(node, "set_materialize_grads"):
            node.set_materialize_grads(False)


def unread_resident_bytes(module: torch.nn.Module, example_inputs) -> int:
    """Bytes of ``module``'s parameters, buffers and existing gradients (each storage once) that
    are not among the captured graph's inputs: the step never reads them, yet they are alive
    throughout it. (A gradient already there when the step starts, under gradient accumulation,
    stays alive while the step runs; the step's new gradient is added into it at the end.)"""
    read = storages(list(example_inputs))
    return sum(n for key, n in storages(module, grads=True).items() if key not in read)


def make_backend(options: Options, on_plan: Callable[[Plan], None], *, stop_after_plan: bool = False,
                 resident: torch.nn.Module | None = None, held_bytes: int = 0, backward_bytes: int = 0,
                 whole_step: bool = True, ask: Callable[[CapturedStep], Any] | None = None):
    """A torch.compile backend that plans each captured graph and runs the rewritten step.
    ``resident``: the module being compiled, when known: its parameters and buffers the step does
    not read are counted in every peak too (a backend given to torch.compile does not see them).
    ``held_bytes``: memory alive through the step that no tensor of the module shows (DDP's
    gradient buckets, `fxopt.distributed.data_parallel`), counted with those. ``backward_bytes``:
    memory alive beside the step's backward only (a piece's: `fxopt.capture.pieces.Reserve`).
    ``whole_step``: each graph is a whole step, not a piece of one planned in order (whose saved
    bytes the later pieces' reserves count from its plan): with ``compiler="inductor"``, where the
    budget admits eager's step or the plan changes nothing, Inductor's own step may run instead
    (`own_step_bound`). ``ask(step)``: instead, capture stops with what ``ask`` returns for the
    `CapturedStep` (`Answered`): several plans of one capture, say."""
    unread = {"bytes": 0, "inputs": []}
    # The state of each step's OFFLOAD copies (`fxopt.ops.offload.HostCopies`), which its ops find
    # by key: kept as long as this backend (and so the steps it compiled), because Inductor does
    # not keep the modules that hold it.
    host_copies = []

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kw):
        if ask is not None:
            raise Answered(ask(CapturedStep(joint, num_fwd_outputs, unread["bytes"], unread["inputs"], backward_bytes)))
        compiled_peak = None
        if whole_step and of_compiled_step(options, joint):
            if "compiled_held" not in kw:
                from fxopt.capture.inductor import CompiledPeakWanted

                raise CompiledPeakWanted
            if kw["compiled_held"] is not None:
                compiled_peak = kw["compiled_held"] + unread["bytes"] + backward_bytes
        t0 = time.perf_counter()
        jg, plan = make_plan(joint, num_fwd_outputs, options, unread["bytes"], backward_bytes=backward_bytes,
                             whole_step=whole_step, compiled_peak_bytes=compiled_peak)
        on_plan(plan)
        fw, bw = split_with_recompute(jg, plan.schedule)
        if hasattr(fw, "_fxopt_host_copies"):
            host_copies.append(fw._fxopt_host_copies)
        bound = own_step_bound(joint, plan, unread["bytes"] + backward_bytes) if whole_step else None
        if bound is not None and options.compiler == "inductor":
            from fxopt.capture.inductor import OWN_STEP_BOUND

            fw.meta[OWN_STEP_BOUND] = bound
        log.debug("fxopt: planned and rewrote the step in %.2f s", time.perf_counter() - t0)
        if stop_after_plan:
            raise PlanReady(plan, fw, bw, jg)
        return fw, bw

    def count_unread(gm: fx.GraphModule, example_inputs) -> None:
        unread["bytes"] = unread_resident_bytes(resident, example_inputs) + held_bytes
        unread["inputs"] = list(example_inputs)

    return step_backend(partition, options, count_unread if resident is not None else None)


def of_compiled_step(options: Options, joint: fx.GraphModule | None = None) -> bool:
    """Whether ``options``' budget is a share of the compiled step's measured peak: a fraction, with
    ``compiler="inductor"``, planned anew (no given plan), for a step (``joint``, where known)
    without collectives inside (every rank must plan alike, and each would measure on its own)."""
    if options.compiler != "inductor" or options.budget.fraction is None or options.plan is not None:
        return False
    return joint is None or not _has_collectives(joint)


def _has_collectives(joint: fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and "c10d" in n.target.namespace
               for n in joint.graph.nodes)


def own_step_bound(joint: fx.GraphModule, plan: Plan, held_bytes: int) -> int | None:
    """Where the budget admits the step as eager runs it (at least its predicted eager peak: a
    fraction of 1.0 or more) or as Inductor's own step ran when measured (at least
    ``plan.compiled_peak_bytes``), or the plan changes nothing in it (nothing RECOMPUTEd, COMPRESSed or
    OFFLOADed), the most the step's graph may hold for the budget to hold: the budget less
    ``held_bytes`` (what is alive beside the graph: parameters it does not read, existing
    gradients, a piece's reserve), its inputs and everything it allocates counted. Another
    compiler's own step (Inductor's: `fxopt.capture.inductor`) may then run in the plan's place if
    it measures within that. None where it may not: a step with random ops (their draws are eager's
    only in fxopt's modules); a step with collectives inside (every rank must run the same code,
    and each rank would decide on its own measurement)."""
    changes = plan.recomputed or plan.compressed or plan.offloaded or plan.recompute_comm_bytes
    admitted = plan.budget_bytes >= min(plan.eager_peak_bytes, plan.compiled_peak_bytes or plan.eager_peak_bytes)
    if changes and not admitted:
        return None
    for n in joint.graph.nodes:
        target = n.target
        if isinstance(target, torch._ops.OpOverload) and ("c10d" in target.namespace or _draws(n)):
            return None
    return plan.budget_bytes - held_bytes


# The arguments of a random op that, at 0, make it draw nothing (attention's dropout).
_DROP_PROBABILITIES = ("dropout_p", "p")


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a random op, unless a dropout probability it is
    given is 0 (CPU attention, ``_scaled_dot_product_flash_attention_for_cpu``, is a random op
    that draws nothing at ``dropout_p=0``)."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name in _DROP_PROBABILITIES:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else arg.default_value)
            return value != 0
    return True


def step_backend(partition: Callable, options: Options, before: Callable | None = None) -> Callable:
    """The one backend fxopt compiles with: AOTAutograd, with ``partition(joint, joint_inputs, *,
    num_fwd_outputs, **kw) -> (fw, bw)`` as its partitioner, the rewritten modules run by
    ``options.compiler`` (boxed FX code, or Inductor: `fxopt.capture.inductor`). ``before(gm,
    example_inputs)``: called with each graph first. Capturing, planning and compiling are not part
    of the step a measurement in progress measures (`fxopt.measuring.not_measured`)."""
    if options.compiler == "inductor":
        from fxopt.capture.inductor import inductor_backend

        compile_graph = inductor_backend(partition, options.inductor_config)
    else:
        compile_graph = eager_backend(partition)

    def compile_step(gm: fx.GraphModule, example_inputs):
        with not_measured(), backward_compiled_now():
            if before is not None:
                before(gm, example_inputs)
            compiled = compile_graph(gm, example_inputs)

        @functools.wraps(compiled)
        def run(*args):
            step_runs()  # a measurement in progress resumes here (`fxopt.measure`)
            return compiled(*args)

        return run

    return compile_step


def backward_compiled_now():
    """AOTAutograd compiles the backward with the forward, not lazily at the step's first backward.

    A lazy compile runs inside the step's backward, under the frames of AOTAutograd's backward
    function, whose locals are the parameters' gradients about to be accumulated. Whatever that
    compile logs with its traceback (torch 2.12's Inductor logs "Failed to pickle cache key" with
    it; torch 2.11's compile-metrics logging raised on fxopt's logging switches) keeps those
    frames alive as long as a log handler keeps the record (pytest's log capture keeps every
    record of a test). A gradient referenced from elsewhere is not taken as ``.grad`` by autograd's
    AccumulateGrad but copied: one more copy of every gradient at the end of the backward, no plan
    counted (ViT: 315,408 B measured against a 255,720 B plan, measured on torch 2.11 and 2.12).
    A step recompiles on a later call too (a model that writes to its config in ``forward``, as
    transformers' classification loss sets ``config.problem_type`` at the first call, recompiles at
    the second), so this is not only the first call's."""
    return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)


def eager_backend(partition: Callable) -> Callable:
    compile_fn = _boxed

    def inference_not_planned(gm, example_inputs):
        # No gradient is needed (torch.no_grad, or nothing requires grad): there is no backward
        # and nothing to rematerialize; the forward runs as captured.
        return _boxed(gm, example_inputs)

    return aot_autograd(
        fw_compiler=compile_fn,
        bw_compiler=compile_fn,
        inference_compiler=inference_not_planned,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def unwrap_compile_error(err: BaseException) -> BaseException:
    """Dynamo wraps what a backend raises; find fxopt's own error inside, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (PlanReady, Answered)) or type(err).__module__.startswith("fxopt"):
            return err
        err = getattr(err, "inner_exception", None) or err.__cause__
    return None


def is_graph_break(err: BaseException) -> bool:
    return isinstance(err, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))
