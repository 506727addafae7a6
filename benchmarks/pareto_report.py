"""Tables, JSON and plots of `benchmarks.pareto`'s rows: per model ``<model>.md``, ``.json``,
``.png``, and ``summary.md`` / ``summary.json`` over all models.

The summary gives, per model and method (one line of the plot), the lowest measured peak the
method reaches and, among its points whose measured peak is at most ~50% of eager's (52%, so that
a budget of exactly half is not lost to rounding), the one with the fewest extra FLOPs. The
dominance check asks, for every point a peer reaches, whether some fxopt point reaches that peak
or lower (within 0.2% of eager's peak) with no more extra FLOPs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import meta_line, mib, write_results

HALF_SHARE = 0.52
# Peaks within this share of eager's peak count as equal: the same schedule can measure a few
# bytes apart between methods (a scalar tensor, BatchNorm's step counter).
PEAK_TOLERANCE = 0.002
FXOPT_METHODS = ("fxopt", "fxopt-inductor")
PEER_METHODS = ("eager", "checkpoint", "compile", "inductor")


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("measured_peak_bytes") is not None]


def lines_of(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by plot line. torch.compile's rows at budgets 1.0 and 0.0 (where no knapsack solver
    runs) belong to every solver line of their backend."""
    lines: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("not_available"):
            continue
        lines.setdefault(r["line"], []).append(r)
    shared = {k: v for k, v in lines.items() if k.startswith("torch.compile") and "(" not in k}
    for key, rs in shared.items():
        solver_lines = [k for k in lines if k.startswith(key + " (")]
        if solver_lines:
            del lines[key]
            for k in solver_lines:
                lines[k] = sorted(lines[k] + rs, key=lambda r: -r["activation_memory_budget"])
    return lines


# ---- summary ------------------------------------------------------------------------------------


def summarize(info: dict, rows: list[dict]) -> list[dict[str, Any]]:
    eager = info.get("eager_measured_peak_bytes")
    out = []
    for line, rs in lines_of(rows).items():
        ms = measured(rs)
        entry: dict[str, Any] = {"model": info["name"], "line": line, "method": rs[0]["method"], "points": len(ms)}
        if not ms:
            entry["status"] = "error" if any(r.get("error") for r in rs) else "no measured point"
            out.append(entry)
            continue
        low = min(ms, key=lambda r: (r["measured_peak_bytes"], r.get("extra_flops") or 0))
        entry.update({
            "lowest_peak_bytes": low["measured_peak_bytes"],
            "lowest_peak_share": low["measured_peak_bytes"] / eager if eager else None,
            "lowest_budget": low["budget"],
            "lowest_extra_flops": low.get("extra_flops"),
            "lowest_step_ratio": low.get("step_ratio"),
            "lowest_grads_equal": low.get("grads_equal"),
        })
        half = [r for r in ms if eager and r["measured_peak_bytes"] <= HALF_SHARE * eager]
        if half:
            h = min(half, key=lambda r: (r.get("extra_flops") or 0, r.get("step_ratio") or 0))
            entry.update({"half_peak_bytes": h["measured_peak_bytes"], "half_budget": h["budget"],
                          "half_extra_flops": h.get("extra_flops"), "half_step_ratio": h.get("step_ratio")})
        out.append(entry)
    return out


def dominance(rows: list[dict]) -> list[dict[str, Any]]:
    """For each measured peer point: the fxopt point with the fewest extra FLOPs among those whose
    measured peak is no higher (within `PEAK_TOLERANCE` of eager's peak)."""
    fx = [r for r in measured(rows) if r["method"] in FXOPT_METHODS]
    eager = next((r["measured_peak_bytes"] for r in measured(rows) if r["method"] == "eager"), 0)
    slack = PEAK_TOLERANCE * eager
    out = []
    for p in measured(rows):
        if p["method"] not in PEER_METHODS:
            continue
        reach = [r for r in fx if r["measured_peak_bytes"] <= p["measured_peak_bytes"] + slack]
        best = min(reach, key=lambda r: (r.get("extra_flops") or 0, r["measured_peak_bytes"])) if reach else None
        # Inductor's own kernels are invisible to the FLOP counter, so its count can fall below
        # eager's: compare against no extra FLOPs then.
        peer_extra = max(p.get("extra_flops") or 0, 0)
        if best is None:
            verdict = "fxopt does not reach this peak"
        elif (best.get("extra_flops") or 0) <= peer_extra:
            verdict = "yes"
        else:
            verdict = "fxopt needs more FLOPs"
        out.append({"peer": p["line"], "peer_budget": p["budget"], "peer_peak_bytes": p["measured_peak_bytes"],
                    "peer_extra_flops": p.get("extra_flops"), "peer_step_ratio": p.get("step_ratio"),
                    "fxopt": None if best is None else f"{best['line']} @ {best['budget']}",
                    "fxopt_peak_bytes": None if best is None else best["measured_peak_bytes"],
                    "fxopt_extra_flops": None if best is None else best.get("extra_flops"),
                    "fxopt_step_ratio": None if best is None else best.get("step_ratio"),
                    "verdict": verdict})
    return out


# ---- writing ------------------------------------------------------------------------------------


def write_all(out: Path, meta: dict, models: list[tuple[dict, list[dict]]], *,
              current: list[tuple[dict, list[dict]]] | None = None, plots: bool = True) -> None:
    """Write ``<model>.md`` / ``.json`` (and ``.png`` with ``plots``) of the ``current`` models
    (default: all) and the summary of all ``models``."""
    for info, rows in (models if current is None else current):
        name = info["name"]
        write_results(out / name, {"meta": meta, "model": info, "rows": rows}, model_markdown(meta, info, rows))
        if plots and measured(rows):
            plot(out / f"{name}.png", info, rows)
    summary = [(info, summarize(info, rows), dominance(rows)) for info, rows in models]
    write_results(out / "summary", {"meta": meta, "models": [{"model": i, "summary": s, "dominance": d}
                                                             for i, s, d in summary]}, summary_markdown(meta, summary))


def _gflop(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e9:.3f}"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _share(n: int | None, eager: int | None) -> str:
    return "–" if n is None or not eager else f"{n / eager:.0%}"


def header(meta: dict) -> str:
    state = "complete" if meta.get("complete") else "INCOMPLETE (partial results)"
    where = meta.get("cuda_device") if meta.get("device", "").startswith("cuda") else \
        f"{meta['cpu_count']} CPUs ({meta['torch_threads']} torch threads)"
    return (f"{meta_line(meta)} · fxopt {meta['fxopt']} · "
            f"Python {meta['python']} · {meta['device']}: {where} · {state}, {meta.get('elapsed_s', 0):.0f} s · "
            f"sizes \"{meta['size']}\", fp32 · fxopt ILP time limit {meta['ilp_time_limit_s']:g} s · "
            f"{meta['timed_steps']} timed steps per point")


MEASURING = (
    "Measured peak: `fxopt.measure_peak` of one forward+backward after a warm-up step (which compiles and plans): "
    "parameters + inputs + gradients + everything allocated during the step (CPU: profiler allocation events, which "
    "also see Inductor's code; CUDA: `max_memory_allocated`). \"% eager\": of eager's measured peak. fxopt budgets: "
    "100% is the float 1.0 (fxopt's predicted eager peak: nothing to rewrite); other percentages are bytes, that share "
    "of eager's *measured* peak; \"min\" is `InfeasibleBudgetError.min_budget` from planning at a 1-byte budget. "
    "Extra GFLOP: FLOPs counted by a dispatch mode over the step minus eager's (in brackets fxopt's "
    "`plan.recompute_flops` where it differs; inside Inductor's code only the kernels it calls through the dispatcher "
    "are seen). Step ×: median step time over the median of as many eager steps interleaved with it (fastest over "
    "fastest in brackets); the CPU is shared with other jobs, so ratios are noisy (raw times in the JSON). "
    "First call s: compile + plan + first step. Grads equal: `torch.testing.assert_close` against eager's gradients.")


def model_markdown(meta: dict, info: dict, rows: list[dict]) -> str:
    eager = info.get("eager_measured_peak_bytes")
    mins = info.get("min_budget_bytes", {})
    min_s = info.get("min_budget_search_s", {})
    lines = [
        f"# {info['name']}: peak memory vs recompute",
        "",
        header(meta),
        "",
        f"Model: {info['description']}. Parameters {mib(info['params_bytes'])} MiB, inputs {mib(info['inputs_bytes'])} MiB; "
        f"{info['blocks_checkpointed']} blocks under per-block checkpointing; joint graph "
        f"{info.get('graph_nodes', '–')} nodes. Eager peak: measured {mib(eager)} MiB, fxopt's prediction "
        f"{mib(info.get('predicted_eager_peak_bytes'))} MiB. "
        + ("Model " + ("complete" if info.get("complete") else "INCOMPLETE") + f" in {info.get('elapsed_s', 0):.0f} s."),
        "",
    ]
    if mins:
        lines += ["Smallest budget per fxopt solver (search time): " + ", ".join(
            f"{s} {mib(b)} MiB ({min_s.get(s, 0):.1f} s)" for s, b in mins.items()) + ".", ""]
    if info.get("error"):
        lines += [f"**Stopped by an error:** {info['error']}", ""]
    lines += [f"![{info['name']}]({info['name']}.png)", "", MEASURING, "",
              "| method | budget | budget MiB | predicted MiB | measured MiB | % eager | ≤ budget | extra GFLOP "
              "| step × (min) | first call s | solve s | grads equal | plan | notes |",
              "|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|:---:|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(_cells(r, eager)) + " |")
    dom = dominance(rows)
    if dom:
        lines += ["", "## Does fxopt reach each peer's peak with no more extra FLOPs?", "",
                  "| peer point | peer MiB | peer extra GFLOP | peer step × | best fxopt point at or below that peak "
                  "| fxopt MiB | fxopt extra GFLOP | fxopt step × | verdict |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---|"]
        for d in dom:
            lines.append(f"| {d['peer']} @ {d['peer_budget']} | {mib(d['peer_peak_bytes'])} | {_gflop(d['peer_extra_flops'])} "
                         f"| {_ratio(d['peer_step_ratio'])} | {d['fxopt'] or '–'} | {mib(d['fxopt_peak_bytes'])} "
                         f"| {_gflop(d['fxopt_extra_flops'])} | {_ratio(d['fxopt_step_ratio'])} | {d['verdict']} |")
    lines += ["", *checks(rows)]
    return "\n".join(lines) + "\n"


def _cells(r: dict, eager: int | None) -> list[str]:
    notes = "; ".join(r.get("notes", []))
    budget_b = mib(r.get("budget_bytes"))
    if r.get("not_available"):
        return [r["line"], r["budget"], "–", "–", "not available", "–", "–", "–", "–", "–", "–", "–", "–", notes]
    if r.get("infeasible"):
        return [r["line"], r["budget"], budget_b, f"infeasible: min_budget {mib(r['min_budget_bytes'])}", "–", "–", "–",
                "–", "–", f"{r.get('first_call_s', 0):.1f}", "–", "–", "–", notes]
    if r.get("error"):
        return [r["line"], r["budget"], budget_b, "–", "–", "–", "–", "–", "–", f"{r.get('first_call_s', 0):.1f}", "–",
                "–", "–", f"ERROR: {r['error']}" + (f"; {notes}" if notes else "")]
    extra = _gflop(r.get("extra_flops"))
    pred_extra = r.get("predicted_extra_flops")
    if pred_extra is not None and pred_extra != r.get("extra_flops"):
        extra += f" ({_gflop(pred_extra)})"
    within = "–" if r.get("within_budget") is None else ("yes" if r["within_budget"] else "**NO**")
    grads = "–" if "grads_equal" not in r else ("yes" if r["grads_equal"] else
                                                 f"**NO** (max abs diff {r['grad_max_abs_diff']:.1e})")
    plan = f"{r['plan_solver']}, {r['plan_status']}" if r.get("plan_solver") else "–"
    solve = f"{r['solve_seconds']:.2f}" if r.get("solve_seconds") is not None else "–"
    return [r["line"], r["budget"], budget_b, mib(r.get("predicted_peak_bytes")), mib(r["measured_peak_bytes"]),
            _share(r["measured_peak_bytes"], eager), within, extra,
            f"{r['step_ratio']:.2f} ({r['step_ratio_min']:.2f})", f"{r['first_call_s']:.1f}", solve, grads, plan, notes]


def checks(rows: list[dict]) -> list[str]:
    out = ["Automatic checks:"]
    over = [r for r in rows if r.get("within_budget") is False]
    out.append(f"- fxopt points whose measured peak exceeds the budget: {len(over)}"
               + "".join(f"\n  - {r['line']} @ {r['budget']}: measured {mib(r['measured_peak_bytes'])} MiB > budget "
                         f"{mib(r['budget_bytes'])} MiB (predicted {mib(r.get('predicted_peak_bytes'))} MiB)" for r in over))
    bad = [r for r in rows if r.get("grads_equal") is False]
    out.append(f"- points whose gradients differ from eager's: {len(bad)}"
               + "".join(f"\n  - {r['line']} @ {r['budget']}: {r.get('grad_error')}" for r in bad))
    errs = [r for r in rows if r.get("error")]
    out.append(f"- points that raised an error: {len(errs)}"
               + "".join(f"\n  - {r['line']} @ {r['budget']}: {r['error']}" for r in errs))
    inf = [r for r in rows if r.get("infeasible")]
    out.append(f"- fxopt budgets refused as infeasible: {len(inf)}"
               + "".join(f"\n  - {r['line']} @ {r['budget']} ({mib(r['budget_bytes'])} MiB): min_budget "
                         f"{mib(r['min_budget_bytes'])} MiB" for r in inf))
    return out


def summary_markdown(meta: dict, summary: list[tuple[dict, list[dict], list[dict]]]) -> str:
    lines = ["# fxopt vs eager, per-block checkpointing and torch.compile's activation budget: summary", "",
             header(meta), "",
             f"Per model and method: the lowest measured peak the method reaches (share of eager's measured peak), its "
             f"extra GFLOP and step time there; and, among its points at most {HALF_SHARE:.0%} of eager's peak "
             f"(\"~50%\"), the one with the fewest extra FLOPs. Extra GFLOP are counted by a dispatch mode, which sees "
             f"only the matrix products and convolutions Inductor calls, not its own kernels (hence negative counts); "
             f"pointwise ops have no FLOPs in `torch.utils.flop_counter`, so recomputing them counts 0. "
             f"Per-point tables and plots: `<model>.md`, `<model>.png`.",
             "",
             "| model | method | lowest peak MiB (% eager) | at budget | extra GFLOP | step × | at ~50%: peak MiB "
             "| extra GFLOP | step × |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    misses = []
    for info, entries, dom in summary:
        eager = info.get("eager_measured_peak_bytes")
        for e in entries:
            if "lowest_peak_bytes" not in e:
                lines.append(f"| {info['name']} | {e['line']} | {e.get('status', '–')} | | | | | | |")
                continue
            half = (f"{mib(e['half_peak_bytes'])} | {_gflop(e['half_extra_flops'])} | {_ratio(e['half_step_ratio'])}"
                    if "half_peak_bytes" in e else "not reached | – | –")
            lines.append(f"| {info['name']} | {e['line']} | {mib(e['lowest_peak_bytes'])} "
                         f"({_share(e['lowest_peak_bytes'], eager)}) | {e['lowest_budget']} | "
                         f"{_gflop(e['lowest_extra_flops'])} | {_ratio(e['lowest_step_ratio'])} | {half} |")
        misses += [(info["name"], d) for d in dom if d["verdict"] != "yes"]
        if info.get("not_available_note"):
            lines.append(info["not_available_note"])
    lines += ["", "## In short", "", *condensed(summary)]
    n_peer = sum(len(d) for _, _, d in summary)
    lines += ["", "## Where fxopt does not reach a peer's peak with no more extra FLOPs", "",
              f"{n_peer - len(misses)} of {n_peer} measured peer points are matched: some fxopt point (through "
              f"`fxopt.optimize` or its backend) peaks at or below the peer's measured peak with no more extra FLOPs."]
    if misses:
        lines += ["", "| model | peer point | peer MiB | peer extra GFLOP | peer step × | best fxopt point at or below "
                  "| fxopt MiB | fxopt extra GFLOP | fxopt step × | verdict |",
                  "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
        for name, d in misses:
            lines.append(f"| {name} | {d['peer']} @ {d['peer_budget']} | {mib(d['peer_peak_bytes'])} | "
                         f"{_gflop(d['peer_extra_flops'])} | {_ratio(d['peer_step_ratio'])} | {d['fxopt'] or '–'} | "
                         f"{mib(d['fxopt_peak_bytes'])} | {_gflop(d['fxopt_extra_flops'])} | "
                         f"{_ratio(d['fxopt_step_ratio'])} | {d['verdict']} |")
    for name, err in meta.get("model_errors", {}).items():
        lines += ["", f"**{name} could not be run:** {err}"]
    if not meta.get("fxopt_backend_available"):
        lines += ["", "`fxopt.backend` (torch.compile backend with Inductor) is not available in this fxopt: its "
                  "method is recorded as not available."]
    return "\n".join(lines) + "\n"


def condensed(summary: list[tuple[dict, list[dict], list[dict]]]) -> list[str]:
    """One row per model: the lowest peak (extra GFLOP) of each method family, fxopt auto at ~50%."""
    families = [("checkpoint per block", lambda e: e["method"] == "checkpoint"),
                ("torch.compile aot_eager, best solver", lambda e: e["line"].startswith("torch.compile aot_eager")),
                ("torch.compile Inductor", lambda e: e["method"] == "inductor"),
                ("fxopt auto", lambda e: e["line"] == "fxopt auto"),
                ("fxopt backend + Inductor", lambda e: e["method"] == "fxopt-inductor")]
    out = ["Lowest measured peak in MiB (% of eager's; extra GFLOP there), and fxopt auto's cheapest point at "
           f"≤ {HALF_SHARE:.0%} of eager's peak (extra GFLOP, step time × eager's):", "",
           "| model | eager | " + " | ".join(name for name, _ in families) + " | fxopt auto at ~50% |",
           "|---|---:|" + "---:|" * len(families) + "---:|"]
    for info, entries, _ in summary:
        eager = info.get("eager_measured_peak_bytes")
        cells = [info["name"], mib(eager)]
        for _, match in families:
            es = [e for e in entries if match(e) and "lowest_peak_bytes" in e]
            if not es:
                cells.append("–")
                continue
            e = min(es, key=lambda e: (e["lowest_peak_bytes"], e.get("lowest_extra_flops") or 0))
            cells.append(f"{mib(e['lowest_peak_bytes'])} ({_share(e['lowest_peak_bytes'], eager)}; "
                         f"{_gflop(e.get('lowest_extra_flops'))})")
        auto = next((e for e in entries if e["line"] == "fxopt auto"), {})
        cells.append(f"{mib(auto['half_peak_bytes'])} ({_gflop(auto['half_extra_flops'])}; "
                     f"{_ratio(auto['half_step_ratio'])}×)" if "half_peak_bytes" in auto else "not reached")
        out.append("| " + " | ".join(cells) + " |")
    return out


# ---- plot ---------------------------------------------------------------------------------------


def plot(path: Path, info: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eager = info.get("eager_measured_peak_bytes")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    styles = _styles(list(lines_of(rows)))
    for line, rs in lines_of(rows).items():
        # budgets from high to low (torch.compile's rows are already in that order)
        pts = sorted(measured(rs), key=lambda r: -(r.get("budget_bytes") or 0))
        if not pts:
            continue
        color, marker, ls = styles[line]
        xs = [r["measured_peak_bytes"] / 2**20 for r in pts]
        for ax, ys in ((axes[0], [r["step_ratio"] for r in pts]),
                       (axes[1], [(r.get("extra_flops") or 0) / 1e9 for r in pts])):
            big = line == "eager"
            ax.plot(xs, ys, ls, marker=marker, color=color, label=line, ms=12 if big else 6, lw=1.3, alpha=0.9,
                    zorder=5 if big else 3)
            for x, y, r in zip(xs, ys, pts):
                if r["budget"] != "–":
                    ax.annotate(_short_budget(r), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6,
                                color=color)
    for ax in axes:
        if eager:
            ax.axvline(eager / 2**20, color="0.5", lw=0.8, ls=":")
            ax.axvline(HALF_SHARE * eager / 2**20, color="0.75", lw=0.8, ls=":")
        ax.set_xlabel("measured peak of the step (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step time / eager's (median, interleaved)")
    axes[1].set_ylabel("extra GFLOP over eager (counted)")
    axes[0].set_title("peak vs step-time overhead")
    axes[1].set_title("peak vs recompute FLOPs")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"{info['name']}: eager peak {mib(eager)} MiB (dotted: eager and {HALF_SHARE:.0%} of it); "
                 f"labels = budgets", fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short_budget(r: dict) -> str:
    b = r["budget"]
    return b.replace("amb ", "b=")


def _styles(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    fx_colors = ["#08519c", "#3182bd", "#2ca25f", "#006d2c", "#6baed6", "#74c476", "#54278f"]
    peer_colors = ["#d95f02", "#e6ab02", "#a6761d", "#e7298a", "#7570b3", "#666666", "#b15928"]
    markers = "osD^v<>ph"
    out, fi, pi = {}, 0, 0
    for line in lines:
        if line == "eager":
            out[line] = ("black", "*", "-")
        elif line.startswith("fxopt"):
            out[line] = (fx_colors[fi % len(fx_colors)], markers[fi % len(markers)], "-")
            fi += 1
        else:
            out[line] = (peer_colors[pi % len(peer_colors)], markers[(pi + 3) % len(markers)], "--")
            pi += 1
    return out
