"""The docs follow the code: every public name and every argument of the entry points is
documented, every link from the front page resolves, and the front page stays a front page."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import fxopt

ROOT = Path(__file__).resolve().parent.parent
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(set(fxopt.__all__)))
def test_every_public_name_is_documented(name):
    assert any(name in text for text in DOCS.values()), f"fxopt.{name} appears nowhere in docs/"


@pytest.mark.parametrize("function", [fxopt.optimize, fxopt.plan, fxopt.backend], ids=lambda f: f.__name__)
def test_every_argument_of_the_entry_points_is_in_the_usage_page(function):
    usage = DOCS["usage.md"]
    for parameter in inspect.signature(function).parameters:
        if parameter in ("model", "cost_model"):
            continue
        assert re.search(rf"\b{parameter}\b", usage), f"{function.__name__}({parameter}=...) is not in docs/usage.md"


def test_front_page_links_resolve_and_it_stays_short():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link
    assert len(README.splitlines()) < 120
