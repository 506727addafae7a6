"""Compiling and calling fxopt's step through torch.compile, whatever the process compiled before.

Dynamo keeps its state per code object: the compiled entries of each function, how many it may
have, and whether to skip the function altogether. Every torch.compile in the process shares it.
So a user's compile can change what fxopt captures: a ``torch.compile(model)`` that runs under a
TorchDispatchMode (``FlopCounterMode``, a memory tracker) makes Dynamo skip the frames it meets,
and mark their code objects skipped for good, ``type(model).forward`` among them. Compiling
another instance of the same class afterwards captures nothing, or, where the class wraps a
model (a loss around a decoder), only the inner model's frame, while the rest of the step (the
loss) runs eagerly, outside the plan:

    user:   torch.compile(Loss(llama)) under FlopCounterMode   -> Loss.forward marked "skip"
    fxopt:  torch.compile(Loss(qwen))                          -> Loss.forward runs eagerly,
                                                                  qwen's forward is one graph

fxopt therefore enters each step it compiles through a code object of its own, made for that one
compile: the model's ``forward`` is copied (`fresh_forward`) and the copy, bound to the model, is
what fxopt compiles, so Dynamo starts tracing at a frame no other compile has seen, with the
model's own frame structure (a ``print`` in ``forward`` still runs after the graph; Dynamo drops
those of functions it inlines). A ``forward`` Dynamo would not start a frame at (torch's own
modules' ``forward``, which torch.compile enters through a wrapper every such compile shares,
``external_utils.inner``) is entered through a new frame around the copy, as functions are
(`own_frame`). Dynamo inlines everything the step calls into the graph (a skip mark applies to a
frame Dynamo is asked to enter, not to a function it inlines), and its compiled entries and
recompile limit are that compile's alone. What a frame that runs later could still meet (a step
split at graph breaks re-enters the model's own functions) is checked after the call: a step's
autograd graph must hold nothing computed outside the graphs fxopt planned
(`fxopt.capture.coverage`).

Compiling the bound copy calls the model's ``forward`` without ``nn.Module.__call__``, which would
run the model's hooks. A call finds none on the model and none global (the usual case: no Python
around the compiled call, and the model's ``__dict__`` untouched, so Dynamo's guards on it see
the same dictionary each call); where there are some, the call goes through ``nn.Module.__call__``
(the hooks run there, outside the graph, as ``torch.compile(model)`` runs them) with the model's
``forward`` the compiled copy for the call (`_entered_through`; the same frame starts the step).

Dynamo reads fxopt's settings for it (`dynamo_settings`: the recompile limit, no DDP optimizer,
the logging switches) only in its frame callback, which it enters for a frame not in its cache
(to compile it, to recompile it, to mark it skipped), never while a cached graph runs. The patch
costs 70-90 µs, as much as the rest of fxopt's Python around a one-graph step (issue 28), so
`CompiledStep` puts it around the callback (`_SettingsAroundCallback`) and around a call only
while the call before it met such a frame (the first call, a recompile, a step whose Python
between graph breaks Dynamo looks at anew each call): a cached one-graph step runs without it.
Where this torch does not let the callback be wrapped, every call runs inside the patch. Planning's
clock (`fxopt.planner.capture_clock`: capture's time counts against ``time_limit``) starts with
the settings, where Dynamo starts to compile, not at every call.

Any dispatch mode around the call is told to look past the compile (`dispatch_modes_see_the_step`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fxopt.capture.dynamo import is_graph_break, logging_switches, unwrap_compile_error
from fxopt.errors import FxoptError, GraphBreakError
from fxopt.planner import capture_clock

# Dynamo keeps one compiled entry per input signature; past its limit it would silently run
# eagerly. fxopt raises instead, after this many.
RECOMPILE_LIMIT = 64


def own_frame(call: Callable) -> Callable:
    """A function that calls ``call(*args, **kwargs)`` through a new code object, which no other
    compile has seen (see the module docstring)."""
    def fxopt_step(*args, **kwargs):
        return call(*args, **kwargs)

    return _copied(fxopt_step)


def _own_frame_around(forward: types.MethodType) -> Callable:
    """``forward`` (a bound method) called through a new code object, the module it is bound to
    named ``fn`` there, as torch.compile's wrapper of a torch module names it
    (``external_utils.wrap_inline``): Dynamo records the modules of the step under the same paths
    (``L['fn'].0``), in every plan a step of such a module made before."""
    func, fn = forward.__func__, forward.__self__

    def fxopt_step(*args, **kwargs):
        return func(fn, *args, **kwargs)

    return _copied(fxopt_step)


def _copied(func: types.FunctionType) -> types.FunctionType:
    """``func`` with a copy of its code object: Dynamo's state for the copy starts empty."""
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return functools.update_wrapper(copy, func)


def fresh_forward(module: nn.Module) -> Callable | None:
    """``module.forward`` (bound) with a code object of its own, or None where it is not a Python
    function (nothing to copy)."""
    forward = module.forward
    func = getattr(forward, "__func__", forward)
    if not isinstance(func, types.FunctionType):
        return None
    copy = _copied(func)
    return types.MethodType(copy, forward.__self__) if hasattr(forward, "__self__") else copy


@contextlib.contextmanager
def _entered_through(module: nn.Module | None, forward: Callable | None):
    """While inside, ``module.forward`` is ``forward`` (an instance attribute, as
    ``nn.Module.__call__`` reads it), then what it was."""
    if module is None or forward is None:
        yield
        return
    own = module.__dict__
    had, previous = "forward" in own, own.get("forward")
    own["forward"] = forward
    try:
        yield
    finally:
        if had:
            own["forward"] = previous
        else:
            del own["forward"]


class _SettingsAroundCallback:
    """Dynamo's frame callback with fxopt's settings for Dynamo around it (`dynamo_settings`) and
    planning's clock started, unless the call it runs in has them already; it tells ``step`` that
    the call met a frame outside Dynamo's cache (`CompiledStep`)."""

    def __init__(self, callback: Callable, step: CompiledStep):
        self.callback = callback
        self.step = step
        # (What Dynamo reads of its callback: the backend inside, `innermost_backend`; its hooks.)
        self._torchdynamo_orig_backend = callback
        self.hooks = getattr(callback, "hooks", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.step.met_frames = True
        if self.step.settings_on:
            return self.callback(*args, **kwargs)
        with dynamo_settings(self.step.static), capture_clock():
            return self.callback(*args, **kwargs)


def _dynamo_context(compiled: Callable):
    """The Dynamo context ``torch.compile`` made ``compiled`` with (an ``OptimizedModule``'s, or the
    one a compiled function closes over), or None where this torch does not say."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None and getattr(compiled, "__closure__", None):
        cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__))
        ctx = cells["self"].cell_contents if "self" in cells else None
    context_class = getattr(torch._dynamo.eval_frame, "_TorchDynamoContext", None)
    if context_class is None or not isinstance(ctx, context_class) or not callable(getattr(ctx, "callback", None)):
        return None
    return ctx


def _starts_a_frame(forward: Callable) -> bool:
    """Whether Dynamo starts tracing at ``forward`` itself when it is compiled, rather than at the
    wrapper torch.compile puts around a function whose frames it skips (torch's own modules'):
    torch's rule where this torch has it, else no (a frame of fxopt's around it is always right)."""
    check = getattr(getattr(torch._dynamo, "trace_rules", None), "check", None)
    if check is None:
        return False
    try:
        return not check(forward)
    except Exception:  # noqa: BLE001 - another torch's rules: enter through a frame of fxopt's
        return False


# ``nn.Module.__call__``'s own test for global module hooks (where this torch lacks it, always true:
# every call then goes through ``__call__``, which runs whatever there is).
_any_global_hook = getattr(nn.modules.module, "_has_any_global_hook", lambda: True)


class CompiledStep:
    """``torch.compile`` of a module (or a function), entered through a code object of its own (see
    the module docstring). Called like the module. ``met_frames``: the last call met a frame outside
    Dynamo's cache (the next call runs inside fxopt's settings for Dynamo); ``settings_on``: the
    call now running does; ``settled``: Dynamo's callback enters them itself (else every call does);
    ``entry_codes``: the code objects Dynamo may start the step at (a graph from any other frame
    is a piece)."""

    def __init__(self, target: Callable, backend: Callable, *, fullgraph: bool, dynamic: bool | None):
        self.module = target if isinstance(target, nn.Module) else None
        forward = fresh_forward(target) if self.module is not None else None
        if forward is None:
            self.module, entry = None, own_frame(target)
            codes = (entry.__code__,)
        else:
            if _starts_a_frame(forward):
                entry = forward
            else:
                entry = _own_frame_around(forward) if hasattr(forward, "__self__") else own_frame(forward)
            codes = (getattr(forward, "__func__", forward).__code__, getattr(entry, "__func__", entry).__code__)
        self.entry_codes = frozenset(codes)
        # (dynamic=False: in fxopt's settings for Dynamo, `dynamo_settings`, not patched at every call)
        self.static = dynamic is False
        self.compiled = torch.compile(entry, backend=backend, fullgraph=fullgraph,
                                      dynamic=None if self.static else dynamic)
        self.met_frames, self.settings_on = True, False
        self.settled = self._settle(entry)

    def _settle(self, entry: Callable) -> bool:
        """Put fxopt's settings for Dynamo around Dynamo's frame callback (see the module docstring),
        the compiled call made again with it; False where this torch does not let it."""
        ctx = _dynamo_context(self.compiled)
        if ctx is None:
            return False
        ctx.callback = _SettingsAroundCallback(ctx.callback, self)
        self.compiled = ctx(entry)
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.compiled
        m = self.module
        if m is not None and (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                              or _any_global_hook()):
            call = self._through_hooks  # (see the module docstring)
        if self.settled and not self.met_frames:  # (see the module docstring)
            return call(*args, **kwargs)
        self.met_frames, self.settings_on = False, True
        try:
            with dynamo_settings(self.static), capture_clock():
                return call(*args, **kwargs)
        finally:
            self.settings_on = False

    def _through_hooks(self, *args: Any, **kwargs: Any) -> Any:
        """The call through ``nn.Module.__call__``, which runs the model's hooks, its ``forward`` the
        compiled one."""
        with _entered_through(self.module, self.compiled):
            return self.module(*args, **kwargs)


def compile_step(call: Callable, backend: Callable, *, fullgraph: bool, dynamic: bool | None) -> CompiledStep:
    """``torch.compile`` of ``call`` (a module, or a function) entered through a code object of its own."""
    return CompiledStep(call, backend, fullgraph=fullgraph, dynamic=dynamic)


@contextlib.contextmanager
def dynamo_settings(static: bool = False):
    """fxopt's settings for Dynamo (see the module docstring). ``static``: every shape a constant,
    as ``torch.compile(dynamic=False)`` sets, which patches them around every call of the compiled
    step instead (both read only while Dynamo compiles)."""
    cfg = torch._dynamo.config
    # Dynamo's DDP optimizer would split the step at DDP's bucket boundaries: fxopt plans it whole
    # (see fxopt.distributed.data_parallel).
    patch = {"recompile_limit": max(cfg.recompile_limit, RECOMPILE_LIMIT), "optimize_ddp": False}
    if static:
        patch.update(automatic_dynamic_shapes=False, assume_static_by_default=True)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    with logging_switches(**patch):  # (one patch: each costs 0.15 ms, and a step enters here at every call)
        yield


_GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                        "_global_backward_hooks", "_global_forward_hooks_always_called",
                        "_global_forward_hooks_with_kwargs")


def _modes_to_pass(compiler: str) -> list:
    """The dispatch modes around the call that would make Dynamo skip the frame."""
    from torch.utils import _python_dispatch as pd

    modes = [m for m in pd._get_current_dispatch_mode_stack()
             if not m.is_infra_mode() and not m.ignore_compile_internals()]
    if modes and compiler != "eager":
        names = ", ".join(sorted({type(m).__name__ for m in modes}))
        raise FxoptError(
            f"{names} cannot see inside kernels that Inductor generates, so it would miscount "
            "this fxopt step; run it with compiler='eager' (fxopt.optimize(..., compiler='eager')) "
            "where the mode must see every op"
        )
    return modes


@contextlib.contextmanager
def dispatch_modes_see_the_step(compiler: str):
    """Let a TorchDispatchMode around the call (``FlopCounterMode``, a memory tracker) see the
    rewritten step's ops, recomputations included, instead of making Dynamo skip the frame:
    such a mode is told to ignore compile internals for the call, as torch does for modes that
    ask (it is off while compiling and on while the compiled graphs run)."""
    from torch.utils import _python_dispatch as pd

    modes = _modes_to_pass(compiler)
    if not modes:
        yield
        return
    for mode in modes:
        mode.ignore_compile_internals = lambda: True
    flag = getattr(pd, "_is_in_any_mode_without_ignore_compile_internals", None)
    if flag is not None:
        pd._is_in_any_mode_without_ignore_compile_internals = False
    # Modes that attribute ops to modules (FlopCounterMode's ModuleTracker) install global module
    # hooks; the step is one graph now, so it is attributed to the fxopt module as a whole.
    hook_dicts = [getattr(nn.modules.module, name) for name in _GLOBAL_MODULE_HOOKS
                  if hasattr(nn.modules.module, name)]
    stashed = [dict(d) for d in hook_dicts]
    for d in hook_dicts:
        d.clear()
    try:
        yield
    finally:
        for d, saved in zip(hook_dicts, stashed):
            d.update(saved)
        for mode in modes:
            del mode.ignore_compile_internals
        if flag is not None:
            pd._is_in_any_mode_without_ignore_compile_internals = flag


def run_compiled(compiled: Callable, args: tuple, kwargs: dict, compiler: str = "eager") -> Any:
    """Call a step compiled by `compile_step`, with fxopt's errors unwrapped from Dynamo's."""
    try:
        if torch._C._len_torch_dispatch_stack():  # (a mode around the call: rare)
            with dispatch_modes_see_the_step(compiler):
                return compiled(*args, **kwargs)
        return compiled(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - translate what Dynamo wraps into fxopt's errors
        inner = unwrap_compile_error(err)
        if inner is not None and inner is not err:
            raise inner from None
        if is_graph_break(err):
            raise GraphBreakError(
                "fxopt needs the whole training step as one graph, but torch.compile could not "
                f"capture this model in one piece: {str(err).splitlines()[0]}\n"
                "Rewrite the unsupported Python (data-dependent control flow, .item(), unsupported "
                "libraries) or move it out of forward(); or let fxopt.optimize(model, budget) plan "
                "the pieces in order (graph_breaks='split', its default; the budget in bytes)."
            ) from err
        raise
