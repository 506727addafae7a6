"""Pipeline parallelism: fxopt chooses the cuts and plans each stage; torch runs it.

    plan = fxopt.pipeline(model, (x,), target=y, loss_fn=F.cross_entropy, stages=4, microbatches=8,
                          budget="2GiB")                     # once, before any process starts
    schedule = build_schedule(plan, model, F.cross_entropy)  # on every rank
    schedule.step(x, target=y, losses=losses)                # torch's Schedule1F1B (or ScheduleGPipe)

`pipeline` captures one microbatch's step (the model and the loss) as the planner does, gives its
solver graph to the cut solver (`fxopt.solvers.stages`: cut points, the DP, the memory of a stage
on its device under the schedule), builds the stage modules of the DP's cuts with
`torch.distributed.pipelining.pipeline` (a `SplitPoint` at the module boundary each cut falls on;
on the model with its run of identical blocks cut to one stage of each kind, `ShortSplit`),
captures each stage module and plans it with `solve_stage` within the per-device budget: its own
microbatch planned, the other microbatches in flight reserved. A stage that does not fit sends the
DP back with a margin. The result, a `PipelinePlan`, is JSON: plan once, replay on every rank.

`build_schedule` splits the model the same way on each rank, wraps its stage's module with
`fxopt.optimize(..., plan=stage_plan)` (the plan replays, no solve), and returns torch's schedule
over a `PipelineStage`, ready for ``schedule.step(...)``. torch.distributed does all communication
(gloo on CPU, NCCL on GPU: whatever process group the caller made); fxopt has no process-group code.

What runs where: torch's pipe splits the traced forward at the split points; a stage module here
(`StageModule`) takes everything that crosses the cut before it and returns everything that
crosses the cut after it, passing on what later stages read (a skip connection across stages),
because torch's schedules send only between neighbouring stages. The loss runs as torch's
schedules run it, eagerly on the last stage's output; the last stage's plan reserves its eager
memory. Call ``schedule.step(..., return_outputs=False)`` unless the plan was made with
``return_outputs=True`` (then the last stage holds every microbatch's output until the step ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from fxopt.api import FxoptModule
from fxopt.budget import Budget, BudgetLike
from fxopt.capture.repeat import Run, repeated_run
from fxopt.errors import CaptureError, FxoptError, InfeasibleBudgetError, check_choice
from fxopt.fxgraph import module_name
from fxopt.options import Options
from fxopt.plan_ahead import plan_and_rewrite, plan_each
from fxopt.solvers import Solution
from fxopt.solvers.stage_plan import Cut, PipelinePlan, StagePlan, TensorSpec
from fxopt.solvers.stages import (MAX_CROSSING, SCHEDULES, CutModel, InFlight, Split, StageResult, cut_and_plan,
                                  cut_model, pipeline_timing, plan_at_minimum, plan_split, split_at, stage_in_flight)
from fxopt.storage import tensors_in

SCHEDULE_CLASSES = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe"}

# A budget no plan reaches: the capture for the cut solver SAVEs everything.
_UNBOUNDED = 2 ** 62


def check_pipeline(stages: int, microbatches: int, schedule: str, batch: int | None) -> None:
    """Refuse what torch's schedules would refuse, before anything is captured or started."""
    check_choice("schedule", schedule, SCHEDULES)
    if not isinstance(stages, int) or stages < 2:
        raise ValueError(f"stages must be an int of at least 2, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if schedule == "1F1B" and microbatches < stages:
        raise ValueError(f"torch's Schedule1F1B needs at least as many microbatches as stages: {microbatches} "
                         f"microbatches < {stages} stages; use microbatches >= {stages}, or schedule='GPipe'")
    if batch is not None and batch % microbatches:
        raise ValueError(f"the batch of {batch} does not split into {microbatches} equal microbatches; "
                         "use a batch size divisible by the number of microbatches")


@contextlib.contextmanager
def _for_shapes() -> Iterator[None]:
    """Eager forwards run only for what they make (shapes, dtypes, bytes; values a stage is then
    captured on): without autograd, on one torch thread. Their ops are small, and on a busy
    machine torch's threads wait on each other at every one (0.1 CPU s on one thread, 5 at two
    at load 9, for 48 GPT-2 layers); the captures and scratch measurements after run on the
    threads torch was given."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def _bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def sum_loss(output, target=None) -> torch.Tensor:
    """The loss when none is given: the model's output summed (`fxopt.models.loss_of`)."""
    from fxopt.models import loss_of

    return loss_of(output)


class _WithLoss(nn.Module):
    """The step the cut solver sees: the model, then the loss on its output and the target."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs):
        return self.loss_fn(self.model(*inputs[:-1]), inputs[-1])


class _Loss(nn.Module):
    def __init__(self, loss_fn: Callable):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output, target):
        return self.loss_fn(output, target)


def _microbatch(args: tuple, target: Any, microbatches: int) -> tuple[tuple, Any]:
    """The first microbatch, as torch's schedules split a batch."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    chunks, _ = split_args_kwargs_into_chunks((*args, target), None, microbatches)
    return tuple(chunks[0][:-1]), chunks[0][-1]


# ---------------------------------------------------------------- cut points at module boundaries

def module_of(path: str, within: str | None = "model") -> str | None:
    """A captured node's module path (Dynamo's, ``L['self'].model.h[3].attn``) relative to the
    module ``within`` names (``"h.3.attn"``; ``""``: that module's own forward), or None outside
    it (the loss, outside the model). ``within`` None: relative to the captured module itself."""
    path = module_name(path)
    if within is None or path == within:
        return path if within is None else ""
    return path[len(within) + 1:] if path.startswith(within + ".") else None


class SplitPoints:
    """Where torch can split the captured step's forward: between two forward values whose module
    paths show a module call starting (`SplitPoint.BEGINNING` of the outermost module entered) or
    ending (``END`` of the outermost left), the module called once, in one contiguous run."""

    def __init__(self, model: nn.Module, graph, module_paths: Sequence[str]):
        from fxopt.solvers.stages import forward_order

        self.order = forward_order(graph)
        self.paths = paths = [module_of(module_paths[i]) if module_paths else None for i in self.order]
        chains = [None if p is None else _chain(p, model) for p in paths]
        spans: dict[str, list[int]] = {}
        for q, chain in enumerate(chains):
            for fqn in chain or ():
                spans.setdefault(fqn, []).append(q)
        contiguous = {m for m, qs in spans.items() if qs[-1] - qs[0] + 1 == len(qs)}
        self.options: dict[int, list[tuple[str, str]]] = {}
        for q in range(len(self.order) - 1):
            a, b = chains[q], chains[q + 1]
            if a is None or b is None:
                continue
            common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found = [(m, "BEGINNING") for m in b[common:common + 1] if m in contiguous and spans[m][0] == q + 1]
            found += [(m, "END") for m in a[common:common + 1] if m in contiguous and spans[m][-1] == q]
            if found:
                self.options[q] = found

    def allowed(self, q: int) -> bool:
        return q in self.options

    def position_of(self, fqn: str, kind: str) -> int | None:
        return next((q for q, found in self.options.items() if (fqn, kind) in found), None)

    def spec(self, positions: Sequence[int]) -> list[tuple[str, str]]:
        """A split point per position, no module used twice (torch's split spec is a dict)."""
        used: set[str] = set()
        out = []
        for q in positions:
            choice = next((o for o in self.options[q] if o[0] not in used), None)
            if choice is None:
                raise FxoptError(f"two cuts fall on the same module boundary ({self.options[q][0][0]}); "
                                 "ask for fewer stages")
            used.add(choice[0])
            out.append(choice)
        return out


def _chain(path: str, model: nn.Module) -> list[str]:
    """The modules a path runs inside, outermost first, without containers that are never called
    (``nn.ModuleList``, ``nn.ModuleDict``)."""
    parts = path.split(".") if path else []
    chain = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    keep = []
    for fqn in chain:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            continue
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            keep.append(fqn)
    return keep


# ---------------------------------------------------------------- the stage modules

class StageModule(nn.Module):
    """Stage k of a split model as torch's schedules run it: takes what crosses the cut before it
    (the model's inputs on the first stage), runs its part of the model (``part``, torch's
    stage submodule, or fxopt's optimized copy of it) on what that reads, and returns what crosses
    the cut after it: its part's outputs and the values it passes on to later stages (the
    model's output on the last stage)."""

    def __init__(self, part: nn.Module, reads: Sequence[int], returns: Sequence[tuple[str, int]], single: bool):
        super().__init__()
        self.part = part
        self.reads = tuple(reads)  # per argument of ``part``: the index of the input it is
        self.returns = tuple(returns)  # per output: ("part", index into part's outputs) or ("input", index)
        self.single = single

    def part_inputs(self, inputs: Sequence[Any]) -> tuple:
        return tuple(inputs[i] for i in self.reads)

    def forward(self, *inputs):
        out = self.part(*self.part_inputs(inputs))
        outs = out if isinstance(out, tuple) else (out,)
        result = tuple(outs[i] if kind == "part" else inputs[i] for kind, i in self.returns)
        return result[0] if self.single else result


def split_model(model: nn.Module, mb_args: tuple, spec: Sequence[tuple[str, str]], single_output: bool
                ) -> list[StageModule]:
    """The model split by torch's ``pipeline()`` at the split points (module name, ``"BEGINNING"``
    or ``"END"``), as `StageModule`\\ s sharing the model's parameters. The model is left as it was."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    split_spec = {fqn: SplitPoint[kind] for fqn, kind in spec}
    try:
        pipe = pipeline(model, mb_args, split_spec=split_spec)
    except RuntimeError as err:
        raise CaptureError(f"torch.distributed.pipelining could not trace this model: {err}") from err
    finally:
        for fqn in split_spec:  # undo the forward wrappers `pipeline` installs
            module = model.get_submodule(fqn)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_orig_forward", None)
    if pipe.num_stages != len(spec) + 1:
        raise FxoptError(f"torch split the model into {pipe.num_stages} stages, not {len(spec) + 1}: a module at a "
                         f"cut ({', '.join(f for f, _ in spec)}) is called more than once")
    return _stage_modules(pipe, single_output)


def _stage_modules(pipe, single_output: bool) -> list[StageModule]:
    """Read the pipe's root graph: which values each stage reads, and which cross each cut."""
    graph = pipe.split_gm.graph
    if any(n.op == "get_attr" for n in graph.nodes):
        raise FxoptError("a parameter or buffer is used by more than one stage (tied weights?); torch's pipelining "
                         "would give each stage its own copy and their gradients would not be summed")
    calls = [n for n in graph.nodes if n.op == "call_module"]
    stage_of: dict[Any, int] = {n: -1 for n in graph.nodes if n.op == "placeholder"}
    for k, n in enumerate(calls):
        stage_of[n] = k
    for n in graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in stage_of:
            stage_of[n] = stage_of[n.args[0]]
    output = next(n for n in graph.nodes if n.op == "output")
    finals = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    values = [n for n in graph.nodes if n in stage_of and n not in calls or (n in calls and not any(
        u.target is operator.getitem for u in n.users))]
    live = [[v for v in values if stage_of[v] == -1]]
    for k in range(len(calls)):
        later = {a for c in calls[k + 1:] for a in c.args} | (set(finals) if k == len(calls) - 1 else set())
        live.append([v for v in values if stage_of[v] <= k and v in later] if k < len(calls) - 1 else finals)
    stages = []
    for k, call in enumerate(calls):
        before, after = live[k], live[k + 1]
        reads = [before.index(a) for a in call.args]
        returns = [("input", before.index(v)) if stage_of[v] < k else
                   ("part", v.args[1] if v.op == "call_function" else 0) for v in after]
        part = getattr(pipe.split_gm, call.target)
        stages.append(StageModule(part, reads, returns, single_output and k == len(calls) - 1 and len(after) == 1))
    return stages


# ---------------------------------------------------------------- the split of a shorter model

# The fewest identical blocks in a run for the split to be made with the run cut short.
SHORT_SPLIT_FROM = 3


@dataclasses.dataclass(frozen=True)
class ShortSplit:
    """A split whose stages are made by torch's ``pipeline()`` on the model with its run of
    identical blocks (`fxopt.capture.repeat.repeated_run`) cut to its first ``blocks``: a
    middle stage that spans the blocks another one does, cut alike at both ends, is that one
    ``shift`` blocks on, and is left out. 48 GPT-2 blocks in 8 stages of 6:

        the whole, cut at h.6, h.12, ..., h.42:   wte h.0-5 | h.6-11 | h.12-17 | ... | h.42-47 ln_f
        the short one, 18 blocks, at h.6, h.12:   wte h.0-5 | h.6-11 | h.12-17 ln_f
        stand_in: 0 1 1 1 1 1 1 2      shift: 0 0 6 12 18 24 30 30

    torch traces 18 blocks, not 48 (its export and split grow with the blocks). A stage's
    stand-in has its graph, but for the blocks its modules are: the blocks are identical (one
    class, parameters, attributes, no hooks: `repeated_run`), and a cut falls at the same place
    in its block. Where a cut is not inside the run, no shorter model holds every stage (`of`:
    None). The stand-in's plan is the stage's, its module paths moved by ``shift`` blocks
    (`_shifted_pairs`); each rank splits the whole model (`build_schedule`), where the plan's
    graph is checked against the one captured (the plan's fingerprint)."""

    spec: tuple[tuple[str, str], ...]  # the short model's split points
    blocks: int  # the run's blocks the short model keeps (its first)
    stand_in: tuple[int, ...]  # per stage of the whole split: the short split's stage standing in for it
    shift: tuple[int, ...]  # per stage: how many blocks on from its stand-in's its blocks are

    @classmethod
    def of(cls, run: Run, path: str, spec: Sequence[tuple[str, str]]) -> ShortSplit | None:
        """The short split for ``spec`` (split points of the whole model), the run being the
        children of the module at ``path``; None where every cut is not in the run, or no block
        would be left out."""
        cuts = []  # per cut: (its block in the run, its module within the block, its kind)
        for fqn, kind in spec:
            block, within = _in_run(fqn, run, path)
            if block is None:
                return None
            cuts.append((block, within, kind))
        # Middle stage s (between cuts s-1 and s): left out where one before it spans as many
        # blocks between the same kinds of cut, and it starts as it ends (so the cuts around it chain).
        kept: dict[tuple, int] = {}
        short = [cuts[0]]
        stand_in, shift = [0], [0]
        for s in range(1, len(cuts)):
            (a, *start), (b, *end) = cuts[s - 1], cuts[s]
            kind = (b - a, *start, *end)
            if kind in kept and start == end:
                t = kept[kind]
                stand_in.append(t)
                shift.append(a - short[t - 1][0])
                continue
            kept.setdefault(kind, len(short))
            stand_in.append(len(short))
            shift.append(a - short[-1][0])
            short.append((short[-1][0] + b - a, *end))
        stand_in.append(len(short))
        shift.append(cuts[-1][0] - short[-1][0])
        blocks = len(run.keys) - shift[-1]
        if blocks >= len(run.keys):
            return None
        spec_short = tuple((_run_module(run, path, b, within), kind) for b, within, kind in short)
        return cls(spec_short, blocks, tuple(stand_in), tuple(shift))


def _in_run(fqn: str, run: Run, path: str) -> tuple[int | None, str]:
    """The block of the run at ``path`` that the module ``fqn`` is or is in, and its name within
    that block; (None, "") outside the run."""
    prefix = f"{path}." if path else ""
    key, _, within = fqn.removeprefix(prefix).partition(".")
    if not fqn.startswith(prefix) or key not in run.keys:
        return None, ""
    return run.keys.index(key), within


def _run_module(run: Run, path: str, block: int, within: str) -> str:
    return ".".join(p for p in (path, run.keys[block], within) if p)


def _shifted_pairs(part: nn.Module, run: Run, path: str, shift: int) -> dict[str, str]:
    """Each module ``part``'s graphs call (`_module_pairs`) -> the one ``shift`` blocks on in the
    run at ``path`` (the same module for one outside the run)."""
    pairs = {}
    for name in _module_pairs(part, part):
        block, within = _in_run(name, run, path)
        pairs[name] = name if block is None else _run_module(run, path, block + shift, within)
    return pairs


# ---------------------------------------------------------------- planning

def _specs(values: Sequence[Any], grads: bool) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."), grads and t.is_floating_point())
                 for t in values)


def _receivable(values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Values as a stage receives them: leaves, floating ones requiring grad."""
    return tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)


class _StagePlanner:
    """Plans the stages of the DP's splits exactly: builds the stage modules of a split (once per
    split), captures each stage's part and plans it with what its device holds beside.

    The middle stages of a uniform model are one graph up to names (six blocks of a GPT-2 are
    six blocks wherever they sit). A stage whose part has the structure of one captured before
    (`stage_structure`: every node's op and arguments, names abstracted, every parameter's and
    input's shape, dtype and strides, compared whole) is not captured again: it is planned from
    that capture, analysed once (`fxopt.plan_ahead.plan_each`), with its own budget and
    microbatches in flight, and its plan's module paths moved to its own modules (`_moved_paths`,
    checked by reading them back). Where its budget and what it holds beside are those of a stage
    planned before, that plan is its plan. Either way its plan is the one capturing it would make
    (the same graph, names included, and the same solve: the solvers count effort, not time).
    Where the model holds a run of identical blocks, the stages are built by torch's split of the
    model with the run cut short (`ShortSplit`: torch traces the blocks of one stage of each kind,
    the others are those stand-ins with their paths moved by whole blocks); where a path does not
    move, that stage is captured from torch's split of the whole model."""

    # Plan a stage from the capture of a stage with the same structure, the split made with the
    # run cut short (off: split the whole model, capture every stage).
    reuse_same_stages = True

    def __init__(self, model, mb_args, last: _LastStage, points: SplitPoints, cut: CutModel, budget: int | None,
                 options: Options, return_outputs: bool):
        self.model, self.mb_args, self.last = model, mb_args, last
        self.points, self.cut, self.budget, self.options = points, cut, budget, options
        self.return_outputs = return_outputs
        self.single_output = last.single_output
        self.splits: dict[tuple[int, ...], tuple[list[StageModule], list[tuple], list[tuple]]] = {}
        # A run of identical blocks (the split made with it cut short, `ShortSplit`), and per split
        # the blocks each stage's paths move from the stage standing in for it.
        self.run = repeated_run(model, least=SHORT_SPLIT_FROM)
        self.run_path = next((n for n, m in model.named_modules() if m is self.run.holder), None) if self.run else None
        self.shifts: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.whole: dict[tuple[int, ...], list[StageModule]] = {}  # torch's split of the whole, where one is made too
        self.plans: dict[tuple[tuple[int, ...], int], Any] = {}
        self.given: dict[tuple[int, ...], list[tuple[str, str]]] = {}  # cuts -> the split points asked for
        # One entry per stage structure captured: (structure, the part captured, its `plan_each` planner).
        self.captured: list[tuple[tuple, nn.Module, Callable]] = []
        # (structure's entry, the options' solver key with the budget and what is held) -> plan or error
        self.solved: dict[tuple, Any] = {}
        # Counted work: stage parts captured, plans made from a capture made before, plans reused.
        # "blocks split": the run's blocks in the models torch's split traced.
        self.work = {"captures": 0, "planned from an earlier capture": 0, "plans reused": 0, "blocks split": 0}

    def spec(self, cuts: tuple[int, ...]) -> list[tuple[str, str]]:
        return self.given.get(cuts) or self.points.spec([self.cut.points[c].position for c in cuts])

    def modules(self, cuts: tuple[int, ...]) -> tuple[list[StageModule], list[tuple], list[tuple]]:
        """The stage modules of a split, each one's inputs for the first microbatch and its outputs:
        a stage's own, or, where the split is made on the model with its run of blocks cut short
        (`ShortSplit`), those of the stage standing in for it (`self.shifts`: by how many blocks
        its modules' paths move)."""
        if cuts not in self.splits:
            spec = self.spec(cuts)
            short = ShortSplit.of(self.run, self.run_path, spec) if self.reuse_same_stages and self.run is not None else None
            stages = self._split(spec, short)
            if stages is None:
                short, stages = None, self._split(spec, None)
            inputs, outputs, x = [], [], tuple(self.mb_args)
            with _for_shapes():
                for k, stage in enumerate(stages):
                    inputs.append(x if k == 0 else _receivable(x))
                    out = stage(*inputs[-1])
                    x = out if isinstance(out, tuple) else (out,)
                    outputs.append(x)
            if short is not None:
                stages, inputs, outputs = ([every[t] for t in short.stand_in] for every in (stages, inputs, outputs))
            self.shifts[cuts] = short.shift if short is not None else (0,) * len(stages)
            self.splits[cuts] = (stages, inputs, outputs)
        return self.splits[cuts]

    def _split(self, spec: list[tuple[str, str]], short: ShortSplit | None) -> list[StageModule] | None:
        """torch's split of the model at ``spec``, or with ``short``, of the model with its run cut
        short at ``short.spec`` (None where torch cannot split that one: the whole is split)."""
        self.work["blocks split"] += short.blocks if short is not None else len(self.run.keys) if self.run else 0
        if short is None:
            return split_model(self.model, self.mb_args, spec, self.single_output)
        try:
            with self.run.cut_to(short.blocks):
                return split_model(self.model, self.mb_args, short.spec, self.single_output)
        except (FxoptError, RuntimeError):  # (a model whose forward needs every block: split whole)
            return None

    def in_flight(self, s: int, part: nn.Module, inputs: tuple, outputs: tuple) -> InFlight:
        """What the device of stage ``s`` holds beside one microbatch (`runtime_fixed`); on the
        last stage also the loss, which torch runs after its forward, outside its plan (and what
        it SAVEs for each microbatch in flight), and what the last rank holds outside the stage
        and the loss (`_LastStage.outside`: the caller's target, the losses kept; every
        microbatch's output, with ``return_outputs``)."""
        m, last = self.cut.microbatches, s == self.cut.stages - 1
        sent = _bytes(outputs)
        grads = sum(p.numel() * p.element_size() for p in part.parameters() if p.requires_grad)
        return stage_in_flight(self.cut.schedule, self.cut.stages, m, s, _bytes(inputs), sent, grads,
                               held=sent + (self.last.loss_saved if last else 0),
                               extra=self.last.outside(m, self.return_outputs) if last else 0,
                               after_forward=self.last.loss_peak if last else 0)

    def plan_stage(self, s: int, split: Split, budget: int) -> StageResult:
        stages, inputs, outputs = self.modules(split.cuts)
        stage = stages[s]
        in_flight = self.in_flight(s, stage.part, inputs[s], outputs[s])
        options = dataclasses.replace(self.options, budget=Budget(bytes=budget), in_flight=in_flight)
        plan = self._plan(stage.part, stage.part_inputs(inputs[s]), options)
        shift = self.shifts[split.cuts][s]
        if shift:  # (planned on the stage standing in for this one: its modules' paths moved on)
            pairs = _shifted_pairs(stage.part, self.run, self.run_path, shift)
            try:
                plan = dataclasses.replace(plan, module_paths=_moved_paths_by(plan.module_paths, pairs))
            except _NotMoved:  # (not seen) its own part, of torch's split of the whole model
                if split.cuts not in self.whole:
                    self.whole[split.cuts] = self._split(self.spec(split.cuts), None)
                part = self.whole[split.cuts][s].part
                self.work["captures"] += 1
                plan = plan_and_rewrite(part, options, stage.part_inputs(inputs[s])).plan
        self.plans[(split.cuts, s)] = plan
        timeline = plan.timeline()
        graph = plan.graph
        sol = Solution(plan.schedule, timeline, plan.solver, plan.status, plan.solve_seconds)
        return StageResult(sol, in_flight.device_peak(graph, plan.schedule, timeline), in_flight,
                           sum(graph.nodes[i].cost for i in graph.forward_required),
                           sum(graph.nodes[i].cost for i in graph.backward_nodes))

    def _plan(self, part: nn.Module, part_inputs: tuple, options: Options):
        """``part``'s plan for ``options``: captured and planned, or planned from the capture of a
        part of the same structure (`stage_structure`), or that part's plan for the same options."""
        structure = stage_structure(part, part_inputs) if self.reuse_same_stages and options.device is None else None
        if structure is None:
            self.work["captures"] += 1
            return plan_and_rewrite(part, options, part_inputs).plan
        entry = next((k for k, (known, _, _) in enumerate(self.captured) if known == structure), None)
        if entry is None:
            self.work["captures"] += 1
            planner = plan_each(part, options, part_inputs, lambda plan: plan)
            entry = len(self.captured)
            self.captured.append((structure, part, planner))
        else:
            self.work["planned from an earlier capture"] += 1
        _, captured_part, planner = self.captured[entry]
        key = (entry, options.budget.bytes, options.in_flight, options.solver_key())
        if key in self.solved:
            self.work["plans reused"] += 1
        else:
            try:
                self.solved[key] = planner(options).plan
            except InfeasibleBudgetError as err:
                self.solved[key] = err
        known = self.solved[key]
        if isinstance(known, InfeasibleBudgetError):
            raise known
        if captured_part is part:
            return known
        try:
            return dataclasses.replace(known, module_paths=_moved_paths(known.module_paths, captured_part, part))
        except _NotMoved:  # (not seen: Dynamo spells a module's path by its names)
            self.work["captures"] += 1
            return plan_and_rewrite(part, options, part_inputs).plan


# ---------------------------------------------------------------- stages that are one graph

def stage_structure(part: nn.Module, inputs: Sequence[Any]) -> tuple | None:
    """What capturing ``part`` on ``inputs`` depends on, with every name abstracted: per graph
    (the part's, and each module it calls, recursively), every node's op, target (a called
    module by its own structure, an attribute by its tensor's), arguments (a node by its
    position) and type; each module's class and training flag; each tensor's shape, strides,
    dtype, device, whether it requires grad or is a parameter, and which tensors are one (by
    first use). Two parts with equal structures capture to the same joint graph, names included,
    but for the module paths Dynamo records. None where a module in ``part`` is not an fx graph
    (its code is not read here: never matched)."""
    tensors: dict[int, int] = {}

    def tensor(t: torch.Tensor) -> tuple:
        return (tensors.setdefault(id(t), len(tensors)), tuple(t.shape), t.stride(), t.dtype, t.device,
                t.requires_grad, isinstance(t, nn.Parameter))

    def plain(value):
        if isinstance(value, torch.fx.Node):
            return ("node", index[value])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(plain(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, plain(v)) for k, v in value.items()))
        if isinstance(value, torch.Tensor):
            return ("tensor", tensor(value))
        return value

    def module(m: nn.Module):
        graph = getattr(m, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            raise _NotAGraph
        rows = []
        index.update((n, k) for k, n in enumerate(graph.nodes))  # (a node by its place in its graph)
        for n in graph.nodes:
            if n.op == "call_module":
                target = module(m.get_submodule(n.target))
            elif n.op == "get_attr":
                value = _attribute(m, n.target)
                target = tensor(value) if isinstance(value, torch.Tensor) else module(value) \
                    if isinstance(value, nn.Module) else ("value", value)
            elif n.op in ("placeholder", "output"):
                target = None
            else:
                target = n.target
            rows.append((n.op, target, plain(n.args), plain(n.kwargs), n.type))
        own = tuple(tensor(t) for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        # (torch makes a class per GraphModule, whose code is its graph's: known by its base)
        kind = type(m)
        if isinstance(m, torch.fx.GraphModule) and kind.__qualname__.endswith("<locals>.GraphModuleImpl"):
            kind = kind.__mro__[1]
        return (kind, m.training, tuple(rows), own)

    index: dict = {}
    try:
        return (module(part), tuple(tensor(t) if isinstance(t, torch.Tensor) else ("value", t) for t in inputs))
    except _NotAGraph:
        return None


class _NotAGraph(Exception):
    """A module whose forward is Python code, not an fx graph: its structure is not read."""


class _NotMoved(Exception):
    """A module path that could not be moved to the module in its place (`_moved_path`)."""


def _attribute(m: nn.Module, target: str):
    for atom in target.split("."):
        m = getattr(m, atom)
    return m


def _module_pairs(a: nn.Module, b: nn.Module) -> dict[str, str]:
    """Each module ``a``'s graphs call (its path in ``a``) -> the one ``b``'s graphs call in its
    place, for two parts of one `stage_structure` (their graphs line up node by node)."""
    pairs: dict[str, str] = {}

    def walk(x: nn.Module, y: nn.Module, px: str, py: str) -> None:
        for n, o in zip(x.graph.nodes, y.graph.nodes):
            if n.op == "call_module":
                qx, qy = f"{px}{n.target}", f"{py}{o.target}"
                pairs[qx] = qy
                walk(x.get_submodule(n.target), y.get_submodule(o.target), qx + ".", qy + ".")

    walk(a, b, "", "")
    return pairs


def _moved_paths(paths: Sequence[str], captured: nn.Module, part: nn.Module) -> tuple[str, ...]:
    """The module paths Dynamo recorded capturing ``captured`` (``getattr(L['self'].h, '6').ln_1``),
    as it records them capturing ``part``, which has its structure: each path's modules replaced
    by the ones ``part`` calls in their place (`_module_pairs`), one name at a time; every path
    read back (`module_name`) to the module it must name; `_NotMoved` where one is not."""
    return _moved_paths_by(paths, _module_pairs(captured, part))


def _moved_paths_by(paths: Sequence[str], pairs: dict[str, str]) -> tuple[str, ...]:
    """``paths`` with each module replaced by the one ``pairs`` names in its place (`_moved_paths`)."""
    moved: dict[str, str] = {"": ""}
    out = []
    for path in paths:
        if path not in moved:
            moved[path] = _moved_path(path, pairs)
        out.append(moved[path])
    return tuple(out)


def _moved_path(path: str, pairs: dict[str, str]) -> str:
    name = module_name(path)
    base, at, call = name.partition("@")  # (Dynamo's mark of a module's second call: ``resid_drop@1``)
    if not base:  # the part itself
        return path
    if base not in pairs:
        raise _NotMoved(f"a captured module path ({path!r}) names no module the stage's graph calls")
    old, new = base.split("."), pairs[base].split(".")
    if len(old) != len(new):
        raise _NotMoved(f"the module {base!r} and the one in its place, {pairs[base]!r}, are not at one depth")
    text, cursor = path, 0
    for a, b in zip(old, new):
        found = re.compile(r"(?<![\w])" + re.escape(a) + r"(?![\w])").search(text, cursor)
        if found is None:
            raise _NotMoved(f"the module path {path!r} does not spell {base!r} name by name")
        text = text[:found.start()] + b + text[found.end():]
        cursor = found.start() + len(b)
    if module_name(text) != pairs[base] + at + call:
        raise _NotMoved(f"moving the module path {path!r} to {pairs[base]!r} gave {text!r}")
    return text


@dataclasses.dataclass(frozen=True)
class _LastStage:
    """What the last rank runs and holds beside its stage's plan, from one microbatch's model
    output, target and loss (`of`)."""

    single_output: bool  # the model returns one tensor
    output_bytes: int  # the model's output on one microbatch (what the last stage sends to the loss)
    loss_peak: int  # the loss's eager memory beyond the output and target it reads (`_loss_memory`)
    loss_saved: int  # what the loss SAVEs until its backward
    loss_bytes: int  # the loss itself, one microbatch's
    target_bytes: int  # one microbatch's target (0: none given)

    @classmethod
    def of(cls, model: nn.Module, mb_args: tuple, mb_target: Any, loss_fn: Callable, options: Options,
           target_given: bool) -> _LastStage:
        with _for_shapes():
            output = model(*mb_args)
            loss = loss_fn(output, mb_target)
        peak, saved = _loss_memory(loss_fn, output, mb_target, options)
        return cls(isinstance(output, torch.Tensor), _bytes(output), peak, saved, _bytes(loss),
                   _bytes(mb_target) if target_given else 0)

    def outside(self, microbatches: int, return_outputs: bool) -> int:
        """What the last rank holds beside its stage's step and the loss's, whatever the plan: the
        caller's target, every microbatch of it (torch's schedule splits it into views and the
        loss reads each; as the first rank holds the caller's batch); the losses of the other
        microbatches, which torch's schedule keeps (``_internal_losses``) until the step ends; with
        ``return_outputs``, every microbatch's output."""
        m = microbatches
        return m * self.target_bytes + (m - 1) * self.loss_bytes + (m * self.output_bytes if return_outputs else 0)


def _loss_memory(loss_fn, output, target, options: Options) -> tuple[int, int]:
    """The loss's eager memory beyond the output and target it reads (it runs outside the last
    stage's plan, on its output, the gradient it makes included), and what it SAVEs until its
    backward (held per microbatch in flight on GPipe's last stage). The target is planned as a
    copy with storage of its own: torch's microbatch of it is a view of the caller's batch, whose
    whole storage the plan would count (`_LastStage.outside` counts the caller's target)."""
    outputs = [t for t in tensors_in(output) if t.is_floating_point()]
    if not outputs:
        return 0, 0
    leaf = _receivable([output])[0] if isinstance(output, torch.Tensor) else output
    target = tree_map_only(torch.Tensor, torch.clone, target)
    try:
        plan = plan_and_rewrite(_Loss(loss_fn), _unbounded(options), (leaf, target)).plan
    except CaptureError:  # no backward of its own (the output is the loss): nothing beyond it
        return 0, 0
    return max(0, plan.eager_peak_bytes - _bytes(output) - _bytes(target)), plan.timeline().saved_bytes


def pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1F1B",
    budget: BudgetLike | Options,
    loss_fn: Callable | None = None,
    target: Any = None,
    return_outputs: bool = False,
    split_points: Sequence[tuple[str, str]] | None = None,
    **options: Any,
) -> PipelinePlan:
    """Cut ``model``'s training step into ``stages`` pipeline stages and plan each within
    ``budget`` per device (bytes, a size such as ``"2GiB"``, a fraction of the unsplit step's
    eager peak on one microbatch, or ``"min"``: the split with the lowest modelled memory, or the
    ``split_points`` given, at the smallest per-device budget its stages meet, in
    `PipelinePlan.budget_bytes`), for torch's
    ``schedule`` (``"1F1B"`` or ``"GPipe"``) over ``microbatches`` microbatches.

    ``example_inputs``: the model's positional inputs for the whole batch (as ``schedule.step``
    gets them; split along dimension 0). ``loss_fn(output, target)``: the loss the schedule
    computes on the last stage (None: the output summed, and ``target`` may be None). Raises
    `ValueError` for more stages than the step has places to cut or a microbatch count torch's
    schedule refuses, and `InfeasibleBudgetError` (with ``.min_budget``, per device) when no split
    fits. ``budget`` may be a whole `fxopt.Options`; ``options``: its other fields by name, as for
    `fxopt.plan` (``time_limit``, the safety stop, is each solve's: a stage's search and the cut
    model make several, each with counted effort and a stop of its own).
    ``return_outputs``: plan for ``schedule.step(..., return_outputs=True)`` (the last stage
    keeps every microbatch's output). ``split_points``: cut there instead of where the DP would,
    as ``(module name, "BEGINNING" or "END")`` pairs in forward order (torch's `SplitPoint`), and
    plan each stage (e.g. ``[("h.2", "BEGINNING"), ...]``: equal layers).
    """
    t0 = time.perf_counter()
    options = Options.of(budget, **options)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    batch = next((t.shape[0] for t in args if isinstance(t, torch.Tensor) and t.dim()), None)
    check_pipeline(stages, microbatches, schedule, batch)
    loss_fn = loss_fn or sum_loss
    target_given = target is not None
    if not target_given:
        target = torch.zeros(batch or microbatches)
    mb_args, mb_target = _microbatch(args, target, microbatches)
    # (only planned: a run of identical blocks is captured as three and four, stamped out)
    ready = plan_and_rewrite(_WithLoss(model, loss_fn), _unbounded(options), (*mb_args, mb_target), plan_only=True)
    whole = ready.plan
    fx_nodes = {n.name: n for n in ready.joint.module.graph.nodes}
    origins = [fx_nodes[name].meta.get("seq_nr") if name in fx_nodes else None for name in ready.joint.names]
    budget_bytes = None if options.budget.minimum else options.budget.resolve(whole.eager_peak_bytes)
    points = SplitPoints(model, whole.graph, whole.module_paths)
    last = _LastStage.of(model, mb_args, mb_target, loss_fn, options, target_given)
    extra = [0] * stages
    # Beside what the graph shows (the first and last stages' own microbatch of the inputs and target).
    extra[0] = (microbatches - 1) * _bytes(mb_args)
    extra[-1] = last.outside(microbatches, return_outputs) - last.target_bytes
    cut = cut_model(whole.graph, stages, microbatches, schedule, allowed=points.allowed, solver=options.solver,
                    time_limit=options.time_limit, effort=options.effort, extra_fixed=extra,
                    last_held=last.output_bytes, origins=origins)
    planner = _StagePlanner(model, mb_args, last, points, cut, budget_bytes, options, return_outputs)
    if split_points is None:
        if budget_bytes is None:
            split, results, planner.budget = plan_at_minimum(cut, planner.plan_stage)
        else:
            split, results = cut_and_plan(cut, budget_bytes, planner.plan_stage)
    else:
        cuts = _given_cuts(cut, points, split_points, stages)
        planner.given[cuts] = [tuple(p) for p in split_points]
        split = split_at(cut, cuts, budget_bytes)
        if budget_bytes is None:
            split, results, planner.budget = plan_at_minimum(cut, planner.plan_stage, split)
        else:
            results = plan_split(cut, split, budget_bytes, planner.plan_stage)
    return _pipeline_plan(planner, whole, split, results, time.perf_counter() - t0)


def _unbounded(options: Options) -> Options:
    """``options`` for a capture that SAVEs everything (the cut solver's, the loss's)."""
    return dataclasses.replace(options, budget=Budget(bytes=_UNBOUNDED), solver="save_all", plan=None)


def _given_cuts(cut: CutModel, points: SplitPoints, split_points, stages: int) -> tuple[int, ...]:
    """The cut points the given split points fall on (indices into ``cut.points``)."""
    if len(split_points) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} split points, got {len(split_points)}")
    at = {p.position: k for k, p in enumerate(cut.points)}
    cuts = []
    for fqn, kind in split_points:
        q = points.position_of(fqn, kind)
        if q is None or q not in at:
            raise ValueError(f"the split point ({fqn!r}, {kind!r}) is not at a module boundary where at most "
                             f"{MAX_CROSSING} tensors cross; the cut points are at "
                             + ", ".join(f"{m} {k}" for c in cut.points for m, k in points.options[c.position][:1]))
        cuts.append(at[q])
    if cuts != sorted(set(cuts)):
        raise ValueError("the split points must be distinct and in forward order")
    return tuple(cuts)


def _pipeline_plan(planner: _StagePlanner, whole, split: Split, results: list[StageResult], seconds: float
                   ) -> PipelinePlan:
    cut = planner.cut
    stages, inputs, outputs = planner.modules(split.cuts)
    spec = planner.spec(split.cuts)
    names = [n.name for n in whole.graph.nodes]
    cuts = tuple(Cut(fqn, kind, tuple(names[v] for v in cut.points[c].crossing), cut.points[c].bytes)
                 for (fqn, kind), c in zip(spec, split.cuts))
    stage_plans = []
    for s, (stage, result, estimate, outs) in enumerate(zip(stages, results, split.estimates, outputs)):
        paths = [module_of(p, None) for p in planner.plans[(split.cuts, s)].module_paths if p]
        paths = [p for p in paths if p]
        stage_plans.append(StagePlan(
            plan=planner.plans[(split.cuts, s)], in_flight=result.in_flight.microbatches,
            peak_bytes=result.device_bytes, held_bytes=result.in_flight.held_bytes,
            fixed_bytes=result.in_flight.fixed_bytes, model_peak_bytes=estimate.device_bytes,
            forward_seconds=result.forward_seconds, backward_seconds=result.backward_seconds,
            recompute_seconds=result.recompute_seconds, sent_bytes=_bytes(outs) if s < len(stages) - 1 else 0,
            model_seconds=estimate.seconds,
            inputs=_specs(inputs[s], s > 0), outputs=_specs(outs, True),
            modules=(paths[0], paths[-1]) if paths else ("", "")))
    timing = pipeline_timing([r.forward_seconds for r in results],
                             [r.backward_seconds + r.recompute_seconds for r in results], cut.microbatches,
                             cut.schedule)
    return PipelinePlan(cut.schedule, cut.microbatches, planner.budget, whole.eager_peak_bytes, cuts,
                        tuple(stage_plans), timing.step_seconds, timing.bubble, seconds, planner.return_outputs)


# ---------------------------------------------------------------- running it

def _example(spec: TensorSpec, device) -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)


def build_schedule(plan: PipelinePlan, model: nn.Module, loss_fn: Callable | None = None, *, rank: int | None = None,
                   device: str | torch.device | None = None, group=None, **options: Any):
    """This rank's part of ``plan``: ``model`` split as the plan says, this rank's stage (stage
    ``rank``; by default the rank in ``group``) wrapped with its fxopt plan on ``device`` (by
    default ``cuda:<rank>`` when CUDA is available, else CPU), and torch's schedule over it
    (`torch.distributed.pipelining.Schedule1F1B` or ``ScheduleGPipe``), ready for
    ``schedule.step(x)`` on the first rank, ``schedule.step(target=y, losses=losses)`` on the last,
    ``schedule.step()`` between. The process group must exist (`torch.distributed.init_process_group`,
    one rank per stage). ``options``: fields of `fxopt.Options` for the stage's module (``compiler``,
    ``inductor_config``; the budget and the plan are the plan's)."""
    import torch.distributed as dist
    from torch.distributed import pipelining


    count = len(plan.stages)
    rank = dist.get_rank(group) if rank is None else rank
    if dist.is_initialized() and dist.get_world_size(group) != count:
        raise FxoptError(f"the plan has {count} stages but the process group has {dist.get_world_size(group)} ranks; "
                         "run one rank per stage")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu"))
    mb_args = tuple(_example(t, "cpu") for t in plan.stages[0].inputs)
    with torch.no_grad():
        single = isinstance(model(*mb_args), torch.Tensor)
    stages = split_model(model, mb_args, [(c.module, c.split_point) for c in plan.cuts], single)
    stage, stage_plan = stages[rank], plan.stages[rank]
    place_constants_on(stage.part, device)
    stage.to(device)
    stage.part = optimized_stage(stage.part, Options.of(plan.budget_bytes, **options), stage_plan.plan)
    inputs = tuple(_example(t, "meta").requires_grad_(t.requires_grad) for t in stage_plan.inputs)
    outputs = tuple(_example(t, "meta").requires_grad_(t.requires_grad) for t in stage_plan.outputs)
    runner = pipelining.PipelineStage(stage, rank, count, device, input_args=inputs, output_args=outputs, group=group)
    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[plan.schedule])
    return schedule_class(runner, plan.microbatches, loss_fn=loss_fn or sum_loss)


def place_constants_on(part: nn.Module, device: torch.device) -> None:
    """Point the ``device=`` arguments the tracer burned into ``part``'s graphs (``torch.ones``,
    ``torch.arange``... traced on the CPU) at ``device``, in every graph module inside it, so the
    stage makes its constants where it runs (what `torch.distributed.pipelining.Pipe.build_stage`
    does before it builds a stage; fxopt builds its stages itself, with their shapes given)."""
    for module in part.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        moved = [node for node in module.graph.nodes
                 if node.op == "call_function" and "device" in node.kwargs and node.kwargs["device"] != device]
        for node in moved:
            node.update_kwarg("device", device)
        if moved:
            module.recompile()


def optimized_stage(part: nn.Module, options: Options, plan) -> nn.Module:
    """A stage's part wrapped with its plan. From its first backward on, a microbatch's step
    starts with the gradients of earlier ones held, which `fxopt.FxoptModule` captures as a step
    of its own (those gradients resident in its graph): it replays the same schedule there, made
    for that graph (`fxopt.analysis.joint.with_unread_resident`). The stage's plan already counts
    them (`InFlight`)."""
    from fxopt.analysis.joint import with_unread_resident

    grads = sum(p.numel() * p.element_size() for p in part.parameters() if p.requires_grad)
    alternatives = (with_unread_resident(plan, grads),) if grads else ()
    return FxoptModule(part, dataclasses.replace(options, plan=plan, alternatives=alternatives))


def resident(schedule) -> list:
    """What this rank's stage holds between steps, for `fxopt.measure_peak`'s ``resident``: its
    module, and the receive buffers torch's stage allocates per microbatch at its first step."""
    stage = schedule._stage
    buffers = [info.buffer for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
               for info in infos if getattr(info, "buffer", None) is not None]
    return [stage.submod, buffers]
