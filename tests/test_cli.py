"""The `fxopt` command line: the demo runs, and bad input gets a clean error and exit code."""

import json

import pytest

from fxopt.cli import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, main

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
