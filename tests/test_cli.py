"""The `fxopt` command line: the demo runs, and bad input gets a clean error and exit code."""

import json

import pytest

from fxopt.cli.main import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, main

SMALL = ["demo", "--blocks", "2", "--width", "64", "--batch", "512", "--repeats", "1"]


def test_demo_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main([*SMALL, "--budget", "80%", "--json", str(out)]) == EXIT_OK
    result = json.loads(out.read_text())
    assert result["fxopt"]["measured_peak_bytes"] <= result["plan"]["budget_bytes"]
    assert result["fxopt"]["measured_peak_bytes"] < result["eager"]["measured_peak_bytes"]
    assert result["grads_equal"]
    assert "within the budget" in capsys.readouterr().out


def test_bad_budget_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--budget", "3 potatoes"])
    assert info.value.code == EXIT_USAGE
    assert "cannot read budget" in capsys.readouterr().err


def test_infeasible_budget_names_the_minimum(capsys):
    assert main([*SMALL, "--budget", "1000"]) == EXIT_INFEASIBLE
    assert "smallest feasible budget" in capsys.readouterr().out


# ---------------------------------------------------------------- fxopt inspect
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import argparse  # noqa: E402

import fxopt  # noqa: E402
from fxopt.budget import Budget  # noqa: E402
from fxopt.cli.main import EXIT_ERROR, build_parser  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models.py"
MLP = f"{EXAMPLES}:mlp"
FAST = ["--time-limit", "5"]


@pytest.mark.slow
def test_inspect_everything_on_an_example(tmp_path, capsys):
    """One run with every output: the summary and table, the code of both modules, a plan that
    reads back, a DOT graph with the decisions, a PNG timeline with the measured curves."""
    paths = {k: tmp_path / f"plan.{k}" for k in ("json", "dot", "png")}
    code = main(["inspect", MLP, "--budget", "50%", *FAST, "--code", "--run", "--json", str(paths["json"]),
                 "--dot", str(paths["dot"]), "--plot", str(paths["png"]), "--top", "5"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    plan = fxopt.Plan.from_json(paths["json"])
    assert plan.budget_bytes == int(0.5 * plan.eager_peak_bytes) and plan.peak_bytes <= plan.budget_bytes
    for text in ("eager", "fxopt plan", "budget", "extra compute: +", f"solver: {plan.solver} ({plan.status})",
                 "saved and recomputed tensors", "RECOMPUTE x", "blocks.", "within the budget",
                 "gradients equal to eager's", "more not shown"):
        assert text in out, text
    assert out.count("def forward(") == 2  # the rewritten forward and backward
    # The table is ordered by size, largest first.
    sizes = [line.split("│")[3].strip() for line in out.splitlines() if "RECOMPUTE x" in line or "│ SAVE" in line]
    assert sizes and sizes == sorted(sizes, key=_bytes, reverse=True)
    dot = paths["dot"].read_text()
    assert dot.startswith(("digraph", "strict digraph")) and "RECOMPUTE x" in dot and "SAVE" in dot
    assert dot.count("->") == sum(len(n.inputs) for n in plan.graph.nodes)
    _check_png(paths["png"])


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _check_png(path):
    """A real image, neither blank nor tiny: two panels of curves."""
    import matplotlib.image

    assert path.stat().st_size > 20_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 800
    assert pixels[..., :3].std() > 0.05  # not a flat image


@pytest.mark.slow
def test_inspect_offload_shows_the_rows_and_draws_the_channels(tmp_path, capsys):
    """--offload on CPU (a dry run with the default bandwidths) at a budget recomputation alone
    cannot meet: OFFLOAD rows, the host line, a DOT graph and a plot with the copy channels, and
    the step run with the plan measured within the budget with eager's gradients."""
    paths = {k: tmp_path / f"plan.{k}" for k in ("dot", "png")}
    code = main(["inspect", MLP, "--budget", "40%", *FAST, "--offload", "on", "--run", "--top", "50",
                 "--dot", str(paths["dot"]), "--plot", str(paths["png"])])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    for text in ("OFFLOAD", "offloaded: ", "in host memory at most", "within the budget", "gradients equal to eager's"):
        assert text in out, text
    assert "OFFLOAD" in paths["dot"].read_text()
    _check_png(paths["png"])


def test_inspect_a_module_factory_and_dict_inputs(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        "import torch\nfrom examples_models import classifier\n\ndef tiny():\n    return classifier()\n")
    (tmp_path / "examples_models.py").write_text(EXAMPLES.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "my_models:tiny", "--budget", "1.0", *FAST]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Classifier" in out and "images=(16, 3, 32, 32) float32, labels=(16,) int64" in out
    assert "saved and recomputed tensors" in out


@pytest.mark.parametrize("spec, message", [
    ("no_colon_here", "must be 'path/to/file.py:factory'"),
    ("missing/file.py:f", "no such file"),
    (f"{EXAMPLES}:nope", "has no 'nope'; it has"),
    ("no_such_package.models:f", "no module named 'no_such_package'"),
    (f"{EXAMPLES}:Classifier", "must return (model, example_inputs)"),
])
def test_inspect_bad_model_spec_is_a_usage_error(spec, message, capsys):
    assert main(["inspect", spec]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_inspect_bad_budget_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["inspect", MLP, "--budget", "150%"])
    assert info.value.code == EXIT_USAGE
    assert "budget" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_infeasible_budget_names_the_minimum(capsys):
    assert main(["inspect", MLP, "--budget", "1MB", "--time-limit", "2"]) == EXIT_INFEASIBLE
    out = capsys.readouterr().out
    assert "smallest feasible budget" in out
    minimum = int(out.split("try: fxopt inspect")[1].split("--budget")[1].split()[0])
    assert minimum > 10**6
    assert main(["inspect", MLP, "--budget", str(minimum), "--time-limit", "2", "-q"]) == EXIT_OK  # it plans


def test_inspect_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["inspect", MLP, "--budget", "1.0", *FAST, "--plot", str(tmp_path / "x.png")]) == EXIT_ERROR
    assert "pip install 'fxopt[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("flags, planned", [
    ([], dict(compiler="eager", compress=True, quantize=None, offload=None, solver="auto", time_limit=60.0, effort=1.0,
              mip_solver=None)),
    (["--compiler", "inductor"], dict(compiler="inductor", compress=True, quantize=None)),
    (["--no-compress"], dict(compiler="eager", compress=False, quantize=None)),
    (["--quantize", "int8"], dict(compiler="eager", compress=True, quantize=fxopt.Quantize("int8"))),
    (["--offload", "on"], dict(offload=True)),
    (["--offload", "off"], dict(offload=False)),
    (["--offload", "1GiB"], dict(offload=2**30)),
    (["--solver", "greedy", "--time-limit", "2.5"], dict(solver="greedy", time_limit=2.5)),
    (["--effort", "2"], dict(effort=2.0)),
    (["--mip-solver", "cbc"], dict(mip_solver="cbc")),
    (["--budget", "min"], dict(budget=Budget(minimum=True))),
])
def test_inspect_planning_flags_reach_the_planner(flags, planned, monkeypatch, capsys):
    """What --compiler, --no-compress and --quantize do once they reach the planner is tested
    with the API (test_backend, test_compression); here, that they reach it, as one
    `fxopt.Options`."""
    import fxopt.plan_ahead

    calls = []

    def plan_and_rewrite(model, options, inputs, plan_only=False):
        calls.append(options)
        raise fxopt.InfeasibleBudgetError(1000, 2000)  # stop here: planning is not what is tested

    monkeypatch.setattr(fxopt.plan_ahead, "plan_and_rewrite", plan_and_rewrite)
    assert main(["inspect", MLP, "--budget", "50%", *flags]) == EXIT_INFEASIBLE
    (options,) = calls
    assert isinstance(options, fxopt.Options)
    assert {k: getattr(options, k) for k in planned} == planned
    assert f"compiler {planned.get('compiler', 'eager')}," in capsys.readouterr().out


def commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {f"fxopt {name}": parser for name, parser in sub.choices.items()}


def test_every_option_with_a_flag_is_on_the_command_line_and_reads_as_the_api():
    """The flags are made from `fxopt.Options` (`fxopt.options.Flag`): each field with a flag is
    one, on both commands, and no option of the API has a second flag elsewhere."""
    from fxopt.options import public_fields

    flagged = {f.name for f in public_fields() if f.metadata["flag"] is not None}
    assert {"budget", "solver", "time_limit", "compiler", "compress", "quantize", "offload"} <= flagged
    for name in ("fxopt demo", "fxopt inspect"):
        dests = {a.dest for a in commands()[name]._actions}
        assert flagged <= dests, f"{name} lacks {flagged - dests}"
        fields = {f.name for f in public_fields()}
        assert not {d for d in dests if d in fields} - flagged


@pytest.mark.parametrize("flags, message", [
    (["--offload", "50%"], "not a fraction"),
    (["--time-limit", "0"], "time_limit must be a positive number"),
    (["--budget=-1GiB"], "must be positive"),
    (["--solver", "fastest"], "invalid choice"),
])
def test_bad_option_values_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["inspect", MLP, *flags])
    assert info.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "inspect"])
def test_every_flag_has_help(command):
    """`--solver` and demo's flags had none (issue 24, item 12)."""
    for action in commands()[f"fxopt {command}"]._actions:
        assert action.help, f"fxopt {command} {'/'.join(action.option_strings) or action.dest} has no help"


def test_verbose_logs_and_quiet_prints_nothing(capsys):
    assert main(["inspect", MLP, "--budget", "1.0", *FAST, "-v"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "planning a step of" in captured.err
    assert main(["inspect", MLP, "--budget", "1.0", *FAST, "-q"]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.slow
def test_python_dash_m_fxopt():
    done = subprocess.run([sys.executable, "-m", "fxopt", "inspect", f"{EXAMPLES}:nope"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_USAGE
    assert "has no 'nope'" in done.stderr


TINY = """
import torch, torch.nn as nn
def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(8, 16),)
"""


@pytest.mark.slow
def test_inspect_stages_prints_the_cuts_and_writes_the_plan(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "tiny.py").write_text(TINY)
    plot, plan = tmp_path / "stages.png", tmp_path / "stages.json"
    assert main(["inspect", f"{tmp_path / 'tiny.py'}:tiny", "--stages", "2", "--microbatches", "2", "--budget", "90%",
                 "--time-limit", "1", "--json", str(plan), "--plot", str(plot)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "fxopt pipeline (2 stages, 2 microbatches, 1F1B" in out and "in flight" in out
    import fxopt

    pipeline = fxopt.PipelinePlan.from_json(plan)
    assert len(pipeline.stages) == 2 and plot.stat().st_size > 0
    assert all(s.peak_bytes <= pipeline.budget_bytes for s in pipeline.stages)


def test_inspect_stages_refuses_one_step_flags_and_names_the_minimum(monkeypatch, capsys):
    assert main(["inspect", MLP, "--stages", "2", "--run"]) == EXIT_USAGE
    assert "a pipeline runs on one process per stage" in capsys.readouterr().err
    import fxopt

    def pipeline(*args, **kwargs):
        raise fxopt.InfeasibleBudgetError(1000, 2000)

    monkeypatch.setattr(fxopt, "pipeline", pipeline)
    assert main(["inspect", MLP, "--stages", "3", "--microbatches", "6"]) == EXIT_INFEASIBLE
    assert "--stages 3 --microbatches 6 --budget 2000" in capsys.readouterr().out
@pytest.mark.slow
def test_inspect_max_batch(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_mlp.py").write_text(
        "import torch\nfrom fxopt.models import ResidualMLP\n\n"
        "def mlp():\n    torch.manual_seed(0)\n    return ResidualMLP(2, 16), (torch.randn(8, 16),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "tiny_mlp:mlp", "--budget", "50%", "--max-batch"]) == EXIT_USAGE
    assert "in bytes" in capsys.readouterr().err
    assert main(["inspect", "tiny_mlp:mlp", "--budget", "96KiB", "--max-batch"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "the largest batch within 96KiB" in out
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if line.count("│") >= 3}
    assert int(rows["eager"]) <= int(rows["fxopt"]) <= int(rows["no schedule above"])
    assert "stopped at the time limit" not in out
    import dataclasses

    import fxopt

    real = fxopt.max_batch
    monkeypatch.setattr(fxopt, "max_batch", lambda *a, **k: dataclasses.replace(real(*a, **k), stopped=("ilp",)))
    assert main(["inspect", "tiny_mlp:mlp", "--budget", "96KiB", "--max-batch", "--time-limit", "30"]) == EXIT_OK
    assert "stopped at the time limit (30 s) in: ilp" in capsys.readouterr().out


WRAPPED = """
import functools
import torch, torch.nn as nn

def returns_tuple(forward):  # a decorator taking *args, as transformers' are: Dynamo names self L['args'][0]
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return (forward(*args, **kwargs),)
    return wrapper

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(32, 32)
    def forward(self, x):
        return torch.tanh(self.gate_proj(x)) + x

class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(Block(), Block())
    @returns_tuple
    def forward(self, x):
        return self.model(x).sum()

def wrapped():
    torch.manual_seed(0)
    return Wrapper(), (torch.randn(64, 32),)
"""


def test_inspect_names_modules_as_the_model_does(tmp_path, capsys):
    """Issue 24, item 12: the module column showed Dynamo's names (``L.args[0].model.layers.0...``)."""
    (tmp_path / "wrapped.py").write_text(WRAPPED)
    assert main(["inspect", f"{tmp_path / 'wrapped.py'}:wrapped", "--budget", "1.0", *FAST]) == EXIT_OK
    out = capsys.readouterr().out
    modules = {line.split("│")[4].strip() for line in out.splitlines() if line.count("│") >= 5}
    assert modules & {"model.0.gate_proj", "model.1.gate_proj", "model.0", "model.1"}, modules
    assert not any("L." in m or "L[" in m or m.startswith("args") for m in modules), modules


@pytest.mark.parametrize("path, name", [
    ("L['args'][0].model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate_proj"),
    ("L['self'].blocks._modules['0'].l1", "blocks.0.l1"),
    ("L['s'].model.0.l", "model.0.l"),
    ("getattr(L.self.h, '3').ln_2", "h.3.ln_2"),
    ("L['self']", ""),
    ("", ""),
])
def test_module_names_are_relative_to_the_model(path, name):
    from fxopt.cli.report import module_name

    assert module_name(path) == name
