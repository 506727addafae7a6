"""The docs follow the code.

- docs/api.md shows every public name with its signature exactly as ``inspect.signature`` prints
  it (a block may be wrapped after ", "), and names every argument under it; `fxopt.Options`, the
  schema every entry point takes, as a table of its fields with their defaults;
- docs/cli.md shows each command's usage exactly as argparse prints it (up to line wrapping; the
  flags made from `fxopt.Options` as one ``[OPTIONS]``), and names every other option;
- every ``fxopt.*`` module and attribute, and every file under fxopt/, tests/, examples/ and
  benchmarks/, that the docs and the front page mention exists, and every link between pages
  resolves (anchors included);
- the front page stays a front page, and its commands do not surprise a CPU-only machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import fxopt
from fxopt.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
API = PAGES["docs/api.md"]
CLI = PAGES["docs/cli.md"]


def one_line(text: str) -> str:
    return " ".join(text.split())


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)  # AttributeError: the path names nothing
        return obj
    raise ModuleNotFoundError(dotted)


# --- docs/api.md: signatures --------------------------------------------------------------------

# A signature block: a ```python block holding ``fxopt.NAME(...)`` (a call) or
# ``class fxopt.NAME(Base, ...)`` (an exception, whose signature is Exception's).
BLOCK = re.compile(r"^```python\n(?P<body>(?:class )?fxopt\.[\w.]+\(.*?)\n```$", re.M | re.S)
BLOCKS = list(BLOCK.finditer(API))
CALLS = {m["body"].split("(", 1)[0]: m for m in BLOCKS if not m["body"].startswith("class ")}
CLASSES = {m["body"].split("(", 1)[0].removeprefix("class "): m for m in BLOCKS if m["body"].startswith("class ")}


def has_signature(obj) -> bool:
    try:
        inspect.signature(obj)
    except ValueError:
        return False
    return True


# Documented as a table of their fields (`test_the_option_table_is_the_schema`), not a signature:
# a new option is one field and one row.
TABLED = {"Options"}


@pytest.mark.parametrize("name", fxopt.__all__)
def test_every_public_name_has_a_signature_block(name):
    obj = getattr(fxopt, name)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        assert f"fxopt.{name}" in CLASSES, f"docs/api.md has no ```python class fxopt.{name}(...)``` block"
    if has_signature(obj) and name not in TABLED:
        assert f"fxopt.{name}" in CALLS, f"docs/api.md has no ```python fxopt.{name}(...)``` block"


@pytest.mark.parametrize("path", sorted(CALLS))
def test_documented_signatures_are_the_real_ones(path):
    real = f"{path}{inspect.signature(resolve(path))}"
    assert one_line(CALLS[path]["body"]) == one_line(real), f"docs/api.md is out of date; the real signature is\n{real}"


@pytest.mark.parametrize("path", sorted(CLASSES))
def test_documented_bases_are_the_real_ones(path):
    real = f"class {path}({', '.join(base.__name__ for base in resolve(path).__bases__)})"
    assert one_line(CLASSES[path]["body"]) == real


@pytest.mark.parametrize("path", sorted(CALLS))
def test_every_argument_is_described_under_its_signature(path):
    block = CALLS[path]
    later = [m.start() for m in BLOCKS if m.start() > block.start()]
    described = API[block.end():min(later, default=len(API))]
    for name, parameter in inspect.signature(resolve(path)).parameters.items():
        if name == "self":
            continue
        stars = {inspect.Parameter.VAR_POSITIONAL: r"\*", inspect.Parameter.VAR_KEYWORD: r"\*\*"}.get(parameter.kind, "")
        assert re.search(rf"`{stars}{name}\b", described), f"{path}: argument {name} is not described under it"


# --- docs/api.md: the options -------------------------------------------------------------------

OPTION_ROW = re.compile(r"^\| `(\w+)` \| (.+?) \| (.+) \|$", re.M)


def option_table() -> dict[str, tuple[str, str]]:
    """The rows of the table under ``## Options``: option -> (default, what it sets)."""
    start = API.index("\n## Options\n")
    section = API[start:API.index("\n## ", start + 1)]
    return {m[1]: (m[2], m[3]) for m in OPTION_ROW.finditer(section)}


def documented_default(field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
        return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory.__name__}()`"
    return "required"


def test_the_option_table_is_the_schema():
    """One row per option users set, in the schema's order, with its default, and a line saying
    what it sets; an option the table lacks (or one it shows that is gone) fails here."""
    from fxopt.options import public_fields

    rows = option_table()
    fields = list(public_fields())
    assert list(rows) == [f.name for f in fields], "docs/api.md's table of options is not fxopt.Options' fields"
    for field in fields:
        assert rows[field.name][0] == documented_default(field), f"option {field.name}: the default is {documented_default(field)}"
        assert len(rows[field.name][1]) > 20, f"option {field.name}: say what it sets"


def test_every_option_is_documented_in_the_schema():
    from fxopt.options import Options

    for field in dataclasses.fields(Options):
        assert len(field.metadata.get("doc", "")) > 20, f"fxopt.Options.{field.name} has no doc"


# --- docs/cli.md: usage -------------------------------------------------------------------------

USAGE = re.compile(r"^```text\n(usage: fxopt\b.*?)\n```$", re.M | re.S)


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found = {"fxopt": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update({f"fxopt {name}": sub for name, sub in action.choices.items()})
    return found


def option_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags made from `fxopt.Options` (documented by the option table of docs/api.md)."""
    from fxopt.options import public_fields

    flagged = {f.name for f in public_fields() if f.metadata["flag"] is not None}
    return [a for a in parser._actions if a.dest in flagged and a.option_strings]


def usage_as_documented(parser: argparse.ArgumentParser) -> str:
    """argparse's usage, the flags made from `fxopt.Options` shown as one ``[OPTIONS]`` (so a new
    option changes no usage block)."""
    usage = one_line(parser.format_usage())
    flags = option_flags(parser)
    for k, action in enumerate(flags):
        part = f"[{action.option_strings[0]}" + (f" {action.metavar or action.dest.upper()}]" if action.nargs != 0 else "]")
        assert part in usage, (part, usage)
        usage = usage.replace(part, "[OPTIONS]" if k == 0 else "").replace("  ", " ")
    return usage


def test_cli_usage_blocks_are_argparses():
    documented = {one_line(u) for u in USAGE.findall(CLI)}
    real = {name: usage_as_documented(p) for name, p in commands().items()}
    for name, usage in real.items():
        assert usage in documented, f"docs/cli.md lacks the usage of `{name}` as argparse prints it:\n{usage}"
    assert documented <= set(real.values()), f"docs/cli.md shows usage argparse no longer prints: {documented - set(real.values())}"


def test_every_cli_option_is_described():
    """In docs/cli.md; a flag made from `fxopt.Options` by its option's row in docs/api.md."""
    rows = option_table()
    for name, parser in commands().items():
        made = {id(a) for a in option_flags(parser)}
        for action in parser._actions:
            if id(action) in made:
                assert action.dest in rows, f"`{name} {action.option_strings[0]}`: docs/api.md has no row for {action.dest}"
                continue
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert re.search(rf"`{option}(?![\w-])", CLI), f"docs/cli.md does not describe `{name} {option}`"


# --- every page: paths and links ----------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])fxopt(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"(?<![\w./~$-])(?:fxopt|tests|examples|benchmarks)/[\w/.-]*\w/?")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def mentions(pattern: re.Pattern) -> list[tuple[str, str]]:
    return sorted({(page, m) for page, text in PAGES.items() for m in pattern.findall(text)})


@pytest.mark.parametrize("page,dotted", mentions(DOTTED))
def test_dotted_paths_exist(page, dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{page} mentions {dotted}, which does not exist ({err})")


@pytest.mark.parametrize("page,path", mentions(FILE))
def test_file_paths_exist(page, path):
    assert (ROOT / path).exists(), f"{page} mentions {path}, which does not exist"


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page,link", sorted({(page, link) for page, text in PAGES.items() for link in LINK.findall(text)}))
def test_links_resolve(page, link):
    if re.match(r"\w+://", link):
        return
    target, _, anchor = link.partition("#")
    path = (ROOT / page).parent / target if target else ROOT / page
    assert path.exists(), f"{page} links to {link}: no such file"
    if anchor and path.suffix == ".md":
        assert anchor in anchors(path.read_text()), f"{page} links to {link}: no heading with that anchor"


def test_front_page_stays_short_and_points_to_the_docs():
    readme = PAGES["README.md"]
    assert len(readme.splitlines()) < 120
    for page in ("docs/design.md", "docs/api.md"):
        assert f"]({page}" in readme, f"README.md does not link to {page}"


def _shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of ``text``, one per line, comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [c for block in blocks for line in block.splitlines() for c in [line.split("#")[0].strip()] if c]


def test_the_front_pages_install_does_not_surprise_a_cpu_only_machine():
    """Issue 24, item 10: a bare ``pip install .`` pulls torch with CUDA (about 5 GB) on a machine
    without it, and the hint came after the command. The CPU build is installed first, in the
    commands as written (a CUDA machine skips that line); .ci/run runs the front page's test
    command."""
    commands = _shell_commands(PAGES["README.md"])
    installs = [k for k, c in enumerate(commands) if re.match(r"pip install (-e )?[.\"']", c)]
    cpu = [k for k, c in enumerate(commands) if "pip install" in c and "download.pytorch.org/whl/cpu" in c]
    assert installs and cpu and cpu[0] < installs[0], "README.md: install the CPU build of torch before fxopt"
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1
    test_command = tests[0].split("&&")[-1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text(), f".ci/run does not run the README's {test_command!r}"


@pytest.mark.parametrize("page", sorted(p for p in PAGES if p.startswith("docs/")))
def test_each_page_says_what_it_is_for(page):
    lines = PAGES[page].splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] and not lines[2].startswith(("#", "`", "|", "-")), (
        f"{page} should open with its title and one line saying what it is for")
