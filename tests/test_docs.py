"""The documentation stays true: links resolve inside the repository, named specs and examples exist,
spec blocks parse, and documented command-line options exist (no kernels run)."""

import importlib.util
import inspect
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import attngen
from attngen.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]
SPEC_PAGES = [ROOT / "docs" / "language.md", ROOT / "docs" / "tutorial.md"]

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
REPO_PATH = re.compile(r"(?<![\w./-])(?:\.\./)?((?:specs|examples)/[A-Za-z0-9_][A-Za-z0-9_.-]*)")
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")
COMMAND_LINE = re.compile(r"\battngen (compile|run|explain|check|bench)\b([^`#\n]*)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(text: str):
    """(info string, body) of every fenced code block, and the prose with code blocks blanked out."""
    blocks, prose, body, fence, info = [], [], [], None, ""
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if fence is None and match:
            fence, info, body = match.group(1), match.group(2), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
            blocks.append((info, "\n".join(body) + "\n"))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, "a code fence is never closed"
    return blocks, "\n".join(prose)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(page: Path) -> frozenset:
    _, prose = _blocks(page.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose.splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def _links(page: Path) -> list[str]:
    _, prose = _blocks(page.read_text())
    return LINK.findall(CODE_SPAN.sub("", prose))


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "language.md", "tutorial.md", "api.md", "cli.md", "semantics.md"} <= names


def test_no_page_says_the_call_refuses_an_argument_it_takes():
    taken = [name for name, p in inspect.signature(attngen.Attention.__call__).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert "kv_len" in taken
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for name in taken:
            assert not re.search(rf"(not|never) accepts? `{name}=?`", text), \
                f"{_rel(page)} says the call does not accept {name}=, which it takes"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve_inside_the_repository(page):
    links = _links(page)
    assert links or page.name != "README.md", f"{_rel(page)}: no links found"
    for target in links:
        assert not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I), \
            f"{_rel(page)}: link {target!r} leaves the repository (docs link only to files in it)"
        path, _, anchor = target.partition("#")
        assert not path.startswith("/"), f"{_rel(page)}: link {target!r} is absolute"
        resolved = (page.parent / path).resolve() if path else page
        assert resolved == ROOT or ROOT in resolved.parents, \
            f"{_rel(page)}: link {target!r} points outside the repository"
        assert resolved.exists(), f"{_rel(page)}: link {target!r}: no such file {resolved.relative_to(ROOT)}"
        if anchor:
            assert resolved.suffix == ".md", f"{_rel(page)}: link {target!r} has an anchor into a non-markdown file"
            assert anchor in _anchors(resolved), \
                f"{_rel(page)}: link {target!r}: no heading with anchor '#{anchor}' in {_rel(resolved)}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_specs_and_examples_exist(page):
    text = page.read_text()
    assert "../shared" not in text, f"{_rel(page)} refers to ../shared, which users of the package do not have"
    for path in REPO_PATH.findall(text):
        path = path.rstrip(".")
        assert (ROOT / path).exists(), f"{_rel(page)} names {path}, which does not exist"


def _whole_specs(page: Path) -> list[str]:
    blocks, _ = _blocks(page.read_text())
    specs = []
    for info, body in blocks:
        if info not in ("attn", "spec"):
            continue
        code = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if code and re.match(r"attention\s", code[0]):
            specs.append(body)
    return specs


@pytest.mark.parametrize("page", SPEC_PAGES, ids=_rel)
def test_spec_blocks_parse(page):
    specs = _whole_specs(page)
    assert specs, f"{_rel(page)}: no ```attn block holding a whole spec"
    for i, text in enumerate(specs):
        try:
            attngen.parse_spec(text, f"{page.name}, spec block {i + 1}")
        except attngen.SpecError as e:
            pytest.fail(f"{_rel(page)}: a spec block does not parse:\n{e}")


def test_the_tutorials_spec_is_the_example_file():
    example = (ROOT / "examples" / "dilated_window.attn").read_text()
    assert example in _whole_specs(ROOT / "docs" / "tutorial.md")


# --- the command line ------------------------------------------------------------------------------

def _commands() -> dict:
    return typer.main.get_command(app).commands


@lru_cache(maxsize=None)
def _help(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return result.output


def _has_option(command: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", _help(command)) is not None


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's text under each `## attngen NAME` heading, by NAME."""
    text = (ROOT / "docs" / "cli.md").read_text()
    parts = re.split(r"^## `attngen (\w+)`\s*$", text, flags=re.M)
    return {name: re.split(r"^## ", body, flags=re.M)[0] for name, body in zip(parts[1::2], parts[2::2])}


def _table_options(section: str) -> set[str]:
    options = set()
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            first_cell = line.split("|")[1]
            options |= set(OPTION.findall(first_cell))
    return options


def test_cli_md_documents_every_command():
    sections = _cli_sections()
    assert set(_commands()) <= set(sections), f"docs/cli.md lacks {set(_commands()) - set(sections)}"


@pytest.mark.parametrize("command", ["compile", "run", "explain", "check", "bench"])
def test_documented_options_exist(command):
    if command not in _commands():
        pytest.skip(f"`attngen {command}` is not in this version")
    documented = _table_options(_cli_sections()[command])
    assert documented, f"docs/cli.md documents no option for `attngen {command}`"
    missing = sorted(o for o in documented if not _has_option(command, o))
    assert not missing, f"docs/cli.md documents {missing} for `attngen {command}`, which its --help lacks"


@pytest.mark.parametrize("command", ["compile", "run", "explain", "check", "bench"])
def test_every_option_is_documented(command):
    if command not in _commands():
        pytest.skip(f"`attngen {command}` is not in this version")
    documented = _table_options(_cli_sections()[command])
    actual = {o for p in _commands()[command].params if p.param_type_name == "option"
              for o in [*p.opts, *p.secondary_opts]}
    missing = sorted(actual - documented - {"--help"})
    assert not missing, f"docs/cli.md does not document {missing} of `attngen {command}`"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_command_lines_use_existing_options(page):
    for command, rest in COMMAND_LINE.findall(page.read_text()):
        if command not in _commands():
            continue
        for option in OPTION.findall(rest):
            assert _has_option(command, option), \
                f"{_rel(page)}: `attngen {command} ... {option}`: {option} is not an option of `attngen {command}`"


COMPILE_RUN = re.compile(r"^\$ attngen compile (.+)\nwrote (\S+) \((\d+) lines\)$", re.M)


@pytest.mark.parametrize("page", [ROOT / "docs" / "tutorial.md", ROOT / "docs" / "cli.md"], ids=_rel)
def test_compile_outputs_state_about_the_lines_it_writes(page):
    # The pages were run on a CPU: without --target, the interpreter's plan. The count moves with
    # every template change, so the figure shown must only be near it.
    runs = COMPILE_RUN.findall(page.read_text())
    assert runs, f"{_rel(page)} shows no `attngen compile` run"
    for command, _, stated in runs:
        words = command.split()
        params = {name: int(value) for name, value in
                  (words[i + 1].split("=") for i, w in enumerate(words) if w in ("-D", "--define"))}
        target = words[words.index("--target") + 1] if "--target" in words else "interpreter"
        lines = len(attngen.compile_source(ROOT / words[0], params=params, target=target).splitlines())
        assert abs(int(stated) - lines) <= lines / 10, (
            f"{_rel(page)}: `attngen compile {command}` writes {lines} lines, the page says {stated}")


# docs/cli.md's figure for the thin module of one catalog spec, on two targets.
THIN_SIZES = re.compile(r"`sliding_window\.attn`: (\d+) lines for `--target h200`, (\d+) for `a100`")


def test_thin_modules_are_as_long_as_cli_md_says_and_hold_no_shared_code():
    stated = THIN_SIZES.search(" ".join((ROOT / "docs" / "cli.md").read_text().split()))
    assert stated, "docs/cli.md states no thin module's length"
    # The budgets: a thin module holds what the spec decides; code no spec changes (the runtime, the families'
    # device libraries) is imported, so a module past them has taken shared code in again.
    for target, figure, budget in (("h200", int(stated[1]), 1300), ("a100", int(stated[2]), 700)):
        lines = len(attngen.compile_source(ROOT / "specs" / "sliding_window.attn", target=target,
                                           thin=True).splitlines())
        assert abs(figure - lines) <= lines / 10, f"docs/cli.md says {figure} lines for {target}, it is {lines}"
        assert lines <= budget, f"the thin sliding_window module for {target} has {lines} lines (budget {budget})"


BENCHMARKS = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "history" / "results"
# "date, raw file" or "date GPU, raw file" (the raw file's name carries the GPU: h200 unless named).
MEASURED = re.compile(r"^(\d{4}-\d{2}-\d{2})(?: (H100|H200))?, (\S+)")


def _benchmark_rows() -> list[list[str]]:
    """The cells of every data row of BENCHMARKS.md's tables: each table's lines after its header and rule."""
    tables, table = [], []
    for line in [*BENCHMARKS.read_text().splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            tables.append(table)
            table = []
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for table in tables for line in table[2:]]


def test_every_benchmark_row_names_its_command_and_raw_file():
    # BENCHMARKS.md holds the current figures: each row says how to measure it again and where its raw
    # file is, so a row whose script, targets.py case or file goes away is caught here.
    targets = sys.modules.get("benchmarks_targets")  # tests/test_targets_script.py loads it the same way
    if targets is None:
        spec = importlib.util.spec_from_file_location("benchmarks_targets", ROOT / "benchmarks" / "targets.py")
        targets = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(targets)
    cases = {case.name for case in targets.cases(False)}
    rows = _benchmark_rows()
    assert len(rows) > 20
    for cells in rows:
        command = re.fullmatch(r"`python (\S+)(.*)`", cells[-1])
        assert command, f"BENCHMARKS.md row {cells[0]!r}: the last cell is not a `python ...` command"
        script, rest = command.groups()
        assert (ROOT / script).is_file(), f"BENCHMARKS.md row {cells[0]!r}: no script {script}"
        for names in re.findall(r"--only (\S+)", rest) if script == "benchmarks/targets.py" else ():
            unknown = set(names.split(",")) - cases
            assert not unknown, f"BENCHMARKS.md row {cells[0]!r}: benchmarks/targets.py has no case {unknown}"
        measured = MEASURED.match(cells[-2])
        assert measured, f"BENCHMARKS.md row {cells[0]!r}: no 'date, raw file' before the command"
        date, gpu, name = measured.groups()
        raw = RESULTS / f"{date}-{(gpu or 'H200').lower()}-{name}"
        assert raw.is_file(), f"BENCHMARKS.md row {cells[0]!r}: no raw file {raw.relative_to(ROOT)}"
