"""`Plan`: what fxopt decided for one training step, JSON-serializable so it can be shown,
replayed (``fxopt.optimize(model, budget, plan=plan)``) and pinned in tests."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

from fxopt.solvers.gap import gap
from fxopt.solvers.graph import Graph, is_lossy_codec
from fxopt.solvers.schedule import Schedule, Timeline, simulate

FORMAT_VERSION = 3  # 3: OFFLOAD (offloaded, host_bytes, exposed_transfer_seconds; transfers on the graph)


class JsonRecord:
    """``to_json`` and ``from_json`` on top of a class's ``to_dict`` and ``from_dict``: a plan
    written to a file or a string, and read back (`Plan`, `fxopt.PipelinePlan`)."""

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path):
        """From JSON text, or the path of a file holding it."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text).read_text()
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class Plan(JsonRecord):
    """A plan for one captured training step.

    Memory figures are predicted by the simulator for the generated code, in bytes, and count
    everything live on the device during forward and backward: parameters, buffers, inputs,
    gradients, activations and temporaries.
    """

    budget_bytes: int
    peak_bytes: int  # predicted peak of the rewritten step
    eager_peak_bytes: int  # predicted peak without rewrite (what eager autograd keeps)
    recompute_flops: int  # FLOPs beyond running every op once (compressing included)
    recompute_cost: float  # the same in the cost model's estimated seconds
    saved: tuple[str, ...]  # SAVEd forward values (fx node names)
    recomputed: dict[str, int]  # RECOMPUTEd forward values -> times recomputed
    solver: str
    status: str  # "optimal" | "feasible" | "heuristic"
    solve_seconds: float
    schedule: Schedule
    graph: Graph
    fingerprint: str
    module_paths: tuple[str, ...] = ()
    # A proven lower bound on the cost (cost model seconds: recompute cost plus exposed transfer
    # time) of any plan within the budget (`fxopt.solvers.Solution.lower_bound_cost` says in
    # which model); None when none was proven. See `gap`.
    lower_bound_cost: float | None = None
    # COMPRESSed SAVEd values (fx node names) -> codec ("bits", "int32", "int8/g64", ...; see
    # `fxopt.analysis.codecs`). Only the quantizing codecs (int8, fp8, int4) are lossy: see `lossy`.
    compressed: dict[str, str] = dataclasses.field(default_factory=dict)
    # OFFLOADed SAVEd values (fx node names), kept in host memory between forward and backward (a
    # COMPRESSed one travels encoded); the most host memory they hold at once; and the seconds the
    # backward is predicted to wait for their reloads (part of the plan's `cost`). The bandwidths
    # are the graph's (``graph.transfers``); the reload points are in the schedule.
    offloaded: tuple[str, ...] = ()
    host_bytes: int = 0
    exposed_transfer_seconds: float = 0.0
    # Bytes the recomputed all-gathers move again (re-gathers of sharded parameters), apart from
    # ``recompute_flops``; their compute is part of ``recompute_cost``, the time the backward is
    # predicted to wait for their communication (each issued ahead of its wait,
    # `fxopt.solvers.prefetch`) ``exposed_comm_seconds``, part of the plan's `cost`.
    recompute_comm_bytes: int = 0
    exposed_comm_seconds: float = 0.0
    # The seconds the forward waits for its all-gathers and the backward for its gradients'
    # reductions (reduce-scatters, all-reduces), as simulated: not in the cost (every plan runs them).
    forward_exposed_comm_seconds: float = 0.0
    reduce_exposed_comm_seconds: float = 0.0
    # Where it was planned for a device profile on fake tensors (``device=``): how its memory was
    # counted, which parts are bounds (`fxopt.devices.DeviceProfile.planning_note`); "" otherwise.
    planned_for: str = ""
    # The step's ops run in the order of ``graph``'s nodes, which fxopt chose for memory
    # (`fxopt.solvers.order`, the ``reorder`` option), not in the order they were captured in;
    # replaying the plan runs them in that order too.
    reordered: bool = False
    # With compiler="inductor": the measured peak of Inductor's own step (plain torch.compile's),
    # which a fractional budget is a share of; None where eager's predicted peak is.
    compiled_peak_bytes: int | None = None

    @property
    def cost(self) -> float:
        """What the solver minimised: recompute cost (codecs included) plus exposed transfer time
        and the re-gathers' exposed communication."""
        return self.recompute_cost + self.exposed_transfer_seconds + self.exposed_comm_seconds

    @property
    def lossy(self) -> dict[str, str]:
        """The compressed values whose codec loses precision (quantized)."""
        return {k: v for k, v in self.compressed.items() if is_lossy_codec(v)}

    @property
    def gap(self) -> float | None:
        """(cost - lower_bound_cost) / cost: how far from optimal this plan may be (0: proven
        optimal; None: unknown). Without OFFLOAD, cost is the recompute cost."""
        return gap(self.cost, self.lower_bound_cost)

    @classmethod
    def build(cls, *, graph: Graph, schedule: Schedule, budget_bytes: int, eager_peak_bytes: int,
              solver: str, status: str, solve_seconds: float, fingerprint: str,
              module_paths: tuple[str, ...] = (), timeline: Timeline | None = None,
              lower_bound_cost: float | None = None, reordered: bool = False,
              compiled_peak_bytes: int | None = None) -> Plan:
        timeline = timeline or simulate(graph, schedule)
        if schedule.offloaded and not schedule.reload_at:
            # Pin the default reload points, so that whoever compiles the plan need not find them.
            schedule = dataclasses.replace(schedule, reload_at=timeline.reload_at)
        counts = collections.Counter(graph.nodes[i].name for i in schedule.recomputed(graph))
        for i in graph.backward_only - schedule.saved:  # computed once in the backward: not a recompute
            name = graph.nodes[i].name
            if name in counts:
                counts[name] -= 1
                if counts[name] == 0:
                    del counts[name]
        return cls(
            budget_bytes=budget_bytes,
            peak_bytes=timeline.peak_bytes,
            eager_peak_bytes=eager_peak_bytes,
            recompute_flops=timeline.recompute_flops,
            recompute_cost=timeline.recompute_cost,
            recompute_comm_bytes=timeline.recompute_comm_bytes,
            exposed_comm_seconds=timeline.exposed_comm_seconds,
            forward_exposed_comm_seconds=timeline.forward_exposed_comm_seconds,
            reduce_exposed_comm_seconds=timeline.reduce_exposed_comm_seconds,
            saved=tuple(graph.nodes[i].name for i in sorted(schedule.saved - graph.free)),
            recomputed=dict(counts),
            solver=solver,
            status=status,
            solve_seconds=solve_seconds,
            schedule=schedule,
            graph=graph,
            fingerprint=fingerprint,
            module_paths=module_paths,
            lower_bound_cost=lower_bound_cost,
            compressed={graph.nodes[i].name: graph.nodes[i].codec for i in sorted(schedule.compressed)},
            offloaded=tuple(graph.nodes[i].name for i in sorted(schedule.offloaded)),
            host_bytes=timeline.host_peak_bytes,
            exposed_transfer_seconds=timeline.exposed_transfer_seconds,
            reordered=reordered,
            compiled_peak_bytes=compiled_peak_bytes,
        )

    def timeline(self) -> Timeline:
        """The schedule simulated on the graph: once per plan (a step in pieces reads its saved
        bytes at every call: simulating there cost 5 ms of a test-size GPT-2's 10 ms step)."""
        cached = self.__dict__.get("_timeline")
        if cached is None:
            cached = self.__dict__["_timeline"] = simulate(self.graph, self.schedule)
        return cached

    def decisions(self) -> dict[str, str]:
        """SAVE, RECOMPUTE, COMPRESS, OFFLOAD or COMPRESS+OFFLOAD (kept encoded in host memory) for
        every forward value the backward needs (free aliases left out)."""
        g, s = self.graph, self.schedule
        out = {}
        for i in sorted(g.needed_by_backward - g.free):
            if i in s.compressed and i in s.offloaded:
                out[g.nodes[i].name] = "COMPRESS+OFFLOAD"
            elif i in s.compressed:
                out[g.nodes[i].name] = "COMPRESS"
            elif i in s.offloaded:
                out[g.nodes[i].name] = "OFFLOAD"
            else:
                out[g.nodes[i].name] = "SAVE" if i in s.saved else "RECOMPUTE"
        return out

    def summary(self) -> str:
        from fxopt.units import format_bytes

        n_re = sum(self.recomputed.values())
        return (
            f"fxopt plan ({self.solver}, {self.status}, {self.solve_seconds:.2f} s): "
            f"peak {format_bytes(self.peak_bytes)} (budget {format_bytes(self.budget_bytes)}, "
            + (f"eager {format_bytes(self.eager_peak_bytes)} as predicted, what a fraction is of)"
               if self.compiled_peak_bytes is None else
               f"eager {format_bytes(self.eager_peak_bytes)} as predicted, plain Inductor's "
               f"{format_bytes(self.compiled_peak_bytes)} as measured, what a fraction is of)")
            + f", {len(self.saved)} saved"
            + (f" ({len(self.compressed)} compressed{', lossy' if self.lossy else ''})" if self.compressed else "")
            + (f" ({len(self.offloaded)} offloaded, {format_bytes(self.host_bytes)} on the host, "
               f"{self.exposed_transfer_seconds * 1e3:.2f} ms exposed)" if self.offloaded else "")
            + ", "
            f"{n_re} recomputations, +{self.recompute_flops / 1e9:.3f} GFLOP"
            + (f", {format_bytes(self.recompute_comm_bytes)} re-gathered ({self.exposed_comm_seconds * 1e3:.2f} ms "
               "exposed)" if self.recompute_comm_bytes else "")
            + ("" if self.gap is None else f", gap to the lower bound {100 * self.gap:.1f}%")
            + communication_waits(self)
            + (f"; {self.planned_for}" if self.planned_for else "")
            + (", ops reordered for memory" if self.reordered else "")
        )

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["schedule"] = self.schedule.to_dict()
        d["graph"] = self.graph.to_dict()
        d["saved"] = list(self.saved)
        d["module_paths"] = list(self.module_paths)
        d["offloaded"] = list(self.offloaded)
        if not self.reordered:  # (no key in the captured order: such a plan's dict is what it always was)
            del d["reordered"]
        if self.compiled_peak_bytes is None:  # (likewise)
            del d["compiled_peak_bytes"]
        for k in ("exposed_comm_seconds", "forward_exposed_comm_seconds", "reduce_exposed_comm_seconds"):
            if not d[k]:  # (nor without a re-gather, or a collective waited for)
                del d[k]
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"plan format {d.get('format_version')} is not {FORMAT_VERSION}; re-plan with this fxopt")
        d = {k: v for k, v in d.items() if k != "format_version"}
        d["schedule"] = Schedule.from_dict(d["schedule"])
        d["graph"] = Graph.from_dict(d["graph"])
        d["saved"] = tuple(d["saved"])
        d["module_paths"] = tuple(d["module_paths"])
        d["offloaded"] = tuple(d["offloaded"])
        return cls(**d)


def communication_waits(plan: Plan) -> str:
    """``plan.summary``'s words on the time the step waits for its collectives, as simulated
    (`fxopt.solvers.schedule.Timeline`): the forward's all-gathers, the re-gathers, the gradients'
    reductions; "" for a step without collectives."""
    if not any(n.comm_seconds for n in plan.graph.nodes):
        return ""
    ms = [1e3 * plan.forward_exposed_comm_seconds, 1e3 * plan.exposed_comm_seconds, 1e3 * plan.reduce_exposed_comm_seconds]
    return (f"; waits for communication {sum(ms):.2f} ms (simulated: forward all-gathers {ms[0]:.2f}, "
            f"re-gathers {ms[1]:.2f}, gradient reductions {ms[2]:.2f})")
