"""What `fxopt inspect` shows of a plan: the saved and recomputed tensors, a graphviz drawing of
the step, and the memory timeline of eager vs planned (and measured) steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fxopt.errors import FxoptError
from fxopt.fxgraph import module_name
from fxopt.solvers.plan import Plan
from fxopt.solvers import eager_timeline

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class TensorRow:
    name: str  # fx node name in the captured joint graph
    decision: str  # "SAVE", "COMPRESS <codec>", "OFFLOAD", "COMPRESS <codec>+OFFLOAD" or "RECOMPUTE"
    times: int  # recomputations (0 for SAVE)
    bytes: int  # bytes of the storage it holds (its base's, for a view)
    module: str  # the nn.Module it comes from ("" when unknown)
    flops: int  # extra FLOPs of its recomputations


def tensor_rows(plan: Plan) -> list[TensorRow]:
    """Every SAVEd value and every RECOMPUTEd one that owns memory, largest first (views, which
    cost nothing, are left out)."""
    g = plan.graph
    index = {n.name: i for i, n in enumerate(g.nodes)}
    paths = plan.module_paths or ("",) * len(g.nodes)

    def size(i: int) -> int:
        node = g.nodes[i]
        return g.nodes[node.storage].bytes if node.storage is not None else node.bytes

    rows = [TensorRow(name, decision(plan, name), 0, size(index[name]), module_name(paths[index[name]]), 0)
            for name in plan.saved]
    order = {name: i for i, name in enumerate(n.name for n in g.nodes)}
    for name, times in plan.recomputed.items():
        i = index[name]
        if g.nodes[i].storage is None and g.nodes[i].bytes > 0:
            rows.append(TensorRow(name, "RECOMPUTE", times, size(i), module_name(paths[i]), times * g.nodes[i].flops))
    rows.sort(key=lambda r: (-r.bytes, order[r.name]))
    return rows


def decision(plan: Plan, name: str) -> str:
    """What the plan does with the SAVEd value ``name``: SAVE, COMPRESS <codec>, OFFLOAD, or
    COMPRESS <codec>+OFFLOAD (the encoding travels)."""
    kept = f"COMPRESS {plan.compressed[name]}" if name in plan.compressed else None
    if name in plan.offloaded:
        return f"{kept}+OFFLOAD" if kept else "OFFLOAD"
    return kept or "SAVE"


def write_dot(plan: Plan, path: str | Path) -> None:
    """The captured step as a graphviz DOT file: inputs grey, forward values white, SAVEd green
    (OFFLOADed purple), RECOMPUTEd orange (with their count), backward values blue; each labelled with its size."""
    import networkx as nx

    try:
        from networkx.drawing.nx_pydot import write_dot as nx_write_dot
        import pydot  # noqa: F401 - networkx needs it to write DOT
    except ImportError as err:
        raise FxoptError("writing DOT needs pydot: pip install 'fxopt[dot]' (or pip install pydot)") from err

    g = plan.graph
    saved, recomputed, offloaded = set(plan.saved), plan.recomputed, set(plan.offloaded)
    paths = plan.module_paths or ("",) * len(g.nodes)
    colors = {"input": "grey85", "forward": "white", "backward": "lightsteelblue1"}
    dot = nx.DiGraph(name="fxopt_plan", rankdir="TB")
    for i, node in enumerate(g.nodes):
        lines = [node.name]
        if node.bytes:
            lines.append(_size(node.bytes))
        module = module_name(paths[i])
        if module:
            lines.append(module)
        color = colors[node.kind]
        if node.name in saved:
            lines.append(decision(plan, node.name))
            color = "plum" if node.name in offloaded else "palegreen"
        elif node.name in recomputed:
            lines.append(f"RECOMPUTE x{recomputed[node.name]}")
            color = "orange"
        dot.add_node(node.name, label=_quote("\\n".join(lines)), shape="box", style="filled", fillcolor=color)
    for node in g.nodes:
        for j in node.inputs:
            dot.add_edge(g.nodes[j].name, node.name)
    nx_write_dot(dot, str(path))


def _quote(text: str) -> str:
    return '"' + text.replace('"', '\\"') + '"'


def _size(n: int) -> str:
    from fxopt.units import format_bytes

    return format_bytes(n)


def plot_timeline(plan: Plan, path: str | Path, measured: dict | None = None, title: str = "") -> None:
    """Draw live memory over the step, eager's and the plan's as the simulator predicts them
    (against ops run), and, given ``measured`` ({label: `fxopt.measure.MemoryTimeline`}), the
    measured ones (against time), each with the budget line; with OFFLOAD, the copies on the two
    channels as the simulator times them. Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise FxoptError("plotting needs matplotlib: pip install 'fxopt[plot]' (or pip install matplotlib)") from err

    predicted = {
        f"eager (predicted, peak {_size(plan.eager_peak_bytes)})": eager_timeline(plan.graph),
        f"fxopt plan (predicted, peak {_size(plan.peak_bytes)})": plan.timeline(),
    }
    copies = list(plan.timeline().copies) if plan.offloaded else []
    rows = 1 + bool(measured) + bool(copies)
    fig = Figure(figsize=(10, 4.2 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    if copies:
        _plot_copies(axes[-1], copies)
        axes = axes[:-1]
    ax = axes[0]
    for (label, timeline), color in zip(predicted.items(), ("tab:blue", "tab:green")):
        ys = [b / MiB for _, _, b in timeline.events]
        ax.step(range(len(ys)), ys, where="post", label=label, color=color)
        backward_starts = next((k for k, e in enumerate(timeline.events) if e[0] == "backward"), None)
        if backward_starts is not None:
            ax.axvline(backward_starts, color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("ops run (dotted: the backward starts)")
    ax.set_title(title or "memory over one training step (forward + backward)")
    if measured:
        mx = axes[1]
        for (label, timeline), color in zip(measured.items(), ("tab:blue", "tab:green", "tab:purple")):
            xs = [t * 1e3 for t in timeline.seconds]
            ys = [b / MiB for b in timeline.live_bytes]
            peak = max(timeline.live_bytes, default=timeline.start_bytes)
            mx.step(xs, ys, where="post", label=f"{label} (measured, peak {_size(peak)})", color=color)
        mx.set_xlabel("time (ms)")
        mx.set_title("measured (profiler allocation events)")
    for a in axes:
        a.axhline(plan.budget_bytes / MiB, color="tab:red", linestyle="--",
                  label=f"budget {_size(plan.budget_bytes)}")
        a.set_ylabel("live memory (MiB)")
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend(loc="upper left", fontsize="small")
    fig.savefig(str(path), dpi=110)


def _plot_copies(ax, copies: list) -> None:
    """The OFFLOAD copies (`fxopt.solvers.transfers.Copy`) on their two channels, in predicted
    seconds: a bar per copy from its start to its end, and in red the time the backward waited
    for a reload (exposed)."""
    lanes = {"d2h": (1, "tab:purple", "device → host (offload)"), "h2d": (0, "tab:cyan", "host → device (reload)")}
    for channel, (y, color, label) in lanes.items():
        bars = [(c.start * 1e3, (c.end - c.start) * 1e3) for c in copies if c.channel == channel]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolor="black", linewidth=0.3, label=label)
    waits = [(c.needed * 1e3, c.exposed * 1e3) for c in copies if c.exposed > 0]
    if waits:
        ax.broken_barh(waits, (-0.45, 0.9), facecolors="tab:red", alpha=0.5, label="backward waits (exposed)")
    ax.set_yticks([0, 1], ["H2D", "D2H"])
    ax.set_xlabel("predicted time (ms)")
    ax.set_title("OFFLOAD copies on the two channels (predicted)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="upper left", fontsize="small")


def pipeline_table(plan):
    """A `PipelinePlan` per stage: the modules it runs, where its cut falls and what crosses it,
    its time per microbatch (recomputation in it), microbatches in flight, predicted memory on
    its device against the budget, and its plan."""
    from rich.table import Table

    from fxopt.units import format_bytes

    table = Table(title="pipeline stages (predicted per microbatch; peak on the stage's device)")
    for col, justify in (("", "right"), ("modules", "left"), ("received", "left"), ("ms (recompute)", "right"),
                         ("in flight", "right"), ("peak", "right"), ("saved/recomputed", "right")):
        table.add_column(col, justify=justify)
    for k, (stage, cut) in enumerate(zip(plan.stages, [None, *plan.cuts])):
        p = stage.plan
        table.add_row(str(k), f"{stage.modules[0]} .. {stage.modules[1]}",
                      "" if cut is None else f"{format_bytes(cut.bytes)} ({len(cut.crossing)})",
                      f"{stage.seconds * 1e3:.2f} ({stage.recompute_seconds * 1e3:.2f})", str(stage.in_flight),
                      f"{format_bytes(stage.peak_bytes)} {100 * stage.peak_bytes / plan.budget_bytes:.0f}%",
                      f"{len(p.saved)}/{sum(p.recomputed.values())}")
    return table


def plot_pipeline(plan, path: str | Path, title: str = "") -> None:
    """Draw each stage's predicted memory on its device (its microbatch's step, the other
    microbatches in flight, what torch's runtime holds) against the budget, and the schedule
    replayed with the stages' predicted times. Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise FxoptError("plotting needs matplotlib: pip install 'fxopt[plot]' (or pip install matplotlib)") from err
    from fxopt.solvers.stages import replay

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    mem, gantt = fig.subplots(2, 1)
    stages = range(len(plan.stages))
    step = [s.plan.peak_bytes / MiB for s in plan.stages]
    others = [(s.peak_bytes - s.plan.peak_bytes - s.fixed_bytes) / MiB for s in plan.stages]
    fixed = [s.fixed_bytes / MiB for s in plan.stages]
    mem.bar(stages, step, label="one microbatch's step (its plan's peak)", color="tab:green")
    mem.bar(stages, others, bottom=step, label="the other microbatches in flight, gradients so far", color="tab:olive")
    mem.bar(stages, fixed, bottom=[a + b for a, b in zip(step, others)], label="receive buffers, loss",
            color="tab:gray")
    mem.axhline(plan.budget_bytes / MiB, color="tab:red", linestyle="--", label=f"budget {_size(plan.budget_bytes)}")
    mem.set_xticks(list(stages), [f"stage {k}\n{s.in_flight} in flight" for k, s in enumerate(plan.stages)])
    mem.set_ylabel("MiB")
    mem.set_title(title or "memory per stage (predicted)")
    mem.legend(loc="lower right", fontsize="small")
    actions = replay([s.forward_seconds for s in plan.stages],
                     [s.backward_seconds + s.recompute_seconds for s in plan.stages], plan.microbatches, plan.schedule)
    for s, kind, b, start, end in actions:
        gantt.broken_barh([(start * 1e3, (end - start) * 1e3)], (s - 0.4, 0.8),
                          facecolors="tab:blue" if kind == "F" else "tab:orange", edgecolor="black", linewidth=0.3)
        gantt.text((start + end) / 2 * 1e3, s, f"{kind}{b}", ha="center", va="center", fontsize=6)
    gantt.set_yticks(list(stages), [f"stage {k}" for k in stages])
    gantt.invert_yaxis()
    gantt.set_xlabel("predicted time (ms)")
    gantt.set_title(f"{plan.schedule}, {plan.microbatches} microbatches: forwards (blue), backwards (orange); "
                    f"bubble {100 * plan.bubble:.0f}%")
    fig.savefig(str(path), dpi=110)
