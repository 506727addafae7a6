"""`PipelinePlan`: where fxopt cut a training step into pipeline stages and how it planned each,
JSON-serializable so that one process plans and every rank replays
(`fxopt.distributed.pipeline.build_schedule`)."""

from __future__ import annotations

import dataclasses

from fxopt.solvers.plan import JsonRecord, Plan
from fxopt.units import format_bytes

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and whether it requires grad: what a stage receives or sends per microbatch."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        return cls(tuple(d["shape"]), d["dtype"], d["requires_grad"])


@dataclasses.dataclass(frozen=True)
class Cut:
    """One cut: torch's split point (a module's qualified name and ``"BEGINNING"`` or ``"END"``,
    `torch.distributed.pipelining.SplitPoint`), the values crossing it (fx node names of the
    captured step) and their bytes per microbatch."""

    module: str
    split_point: str
    crossing: tuple[str, ...]
    bytes: int

    @property
    def label(self) -> str:
        return f"{'before' if self.split_point == 'BEGINNING' else 'after'} {self.module}"


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage: its fxopt plan for one microbatch (``plan``, replayable on the stage module),
    the microbatches whose SAVEd values it holds at once (``in_flight``), its predicted memory on
    the device (``peak_bytes``: the plan's peak, plus ``in_flight - 1`` microbatches' SAVEd values
    and ``held_bytes`` each, plus ``fixed_bytes``: receive buffers, the loss), the DP's model of
    that and of its time (``model_peak_bytes``, ``model_seconds``), its predicted seconds per
    microbatch, what it receives and sends, and the modules it runs (first and last)."""

    plan: Plan
    in_flight: int
    peak_bytes: int
    held_bytes: int
    fixed_bytes: int
    model_peak_bytes: int
    forward_seconds: float
    backward_seconds: float
    recompute_seconds: float
    sent_bytes: int
    model_seconds: float = 0.0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    modules: tuple[str, str] = ("", "")

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds + self.recompute_seconds

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["plan"] = self.plan.to_dict()
        d["inputs"] = [dataclasses.asdict(t) for t in self.inputs]
        d["outputs"] = [dataclasses.asdict(t) for t in self.outputs]
        d["modules"] = list(self.modules)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StagePlan:
        return cls(**{**d, "plan": Plan.from_dict(d["plan"]), "inputs": tuple(map(TensorSpec.from_dict, d["inputs"])),
                      "outputs": tuple(map(TensorSpec.from_dict, d["outputs"])), "modules": tuple(d["modules"])})


@dataclasses.dataclass(frozen=True)
class PipelinePlan(JsonRecord):
    """A training step cut into pipeline stages: the cuts, each stage's plan and memory, and the
    schedule's predicted step time and bubble (the share of device time idle). The budget is per
    device; ``eager_peak_bytes`` is the unsplit step's on one microbatch (what a fractional
    budget is a share of)."""

    schedule: str
    microbatches: int
    budget_bytes: int
    eager_peak_bytes: int
    cuts: tuple[Cut, ...]
    stages: tuple[StagePlan, ...]
    step_seconds: float
    bubble: float
    solve_seconds: float
    return_outputs: bool = False

    @property
    def peak_bytes(self) -> int:
        """The largest predicted device peak of any stage."""
        return max(s.peak_bytes for s in self.stages)

    @property
    def balance(self) -> float:
        """The slowest stage's time over the mean stage time (1.0: balanced)."""
        times = [s.seconds for s in self.stages]
        return max(times) / (sum(times) / len(times)) if sum(times) > 0 else 1.0

    def summary(self) -> str:
        lines = [
            f"fxopt pipeline ({len(self.stages)} stages, {self.microbatches} microbatches, {self.schedule}, "
            f"{self.solve_seconds:.1f} s): budget {format_bytes(self.budget_bytes)} per device, largest stage "
            f"{format_bytes(self.peak_bytes)}; step {self.step_seconds * 1e3:.2f} ms predicted, bubble "
            f"{100 * self.bubble:.1f}%, slowest/mean stage {self.balance:.2f}"]
        for k, (stage, cut) in enumerate(zip(self.stages, [None, *self.cuts])):
            lines.append(
                f"  stage {k}: {stage.modules[0]} .. {stage.modules[1]}"
                + (f" (from {cut.label}, {format_bytes(cut.bytes)} in)" if cut else "")
                + f": {stage.seconds * 1e3:.2f} ms/microbatch (+{stage.recompute_seconds * 1e3:.2f} recompute), "
                f"{stage.in_flight} in flight, peak {format_bytes(stage.peak_bytes)}, {len(stage.plan.saved)} saved, "
                f"{sum(stage.plan.recomputed.values())} recomputations")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["cuts"] = [dataclasses.asdict(c) for c in self.cuts]
        d["stages"] = [s.to_dict() for s in self.stages]
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PipelinePlan:
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"pipeline plan format {d.get('format_version')} is not {FORMAT_VERSION}; "
                             "re-plan with this fxopt")
        d = {k: v for k, v in d.items() if k != "format_version"}
        d["cuts"] = tuple(Cut(**{**c, "crossing": tuple(c["crossing"])}) for c in d["cuts"])
        d["stages"] = tuple(StagePlan.from_dict(s) for s in d["stages"])
        return cls(**d)
