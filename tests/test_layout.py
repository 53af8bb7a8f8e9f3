"""The package's layout: imports run one way, down the pipeline's stages, with no cycle anywhere and no
exception; the report layer never runs the pipeline (it never imports api, cache or emit).

Every import of attngen's own code counts, wherever it is written (module level, inside a function, a
lazy one) and however (`import attngen.x`, `from attngen.x import y`, `from . import y`,
`from .x import y`). An edge goes to each module named (the package itself for a name it defines, `from attngen import build`);
importing `attngen.a.b` also runs the package `attngen.a`, so that is an edge too, except to a package
the importer itself lies in, which Python has already started.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"
# The stages, in the pipeline's order (README.md, "How it works"): a module may import modules of its own
# unit and of units listed before it, never one listed after it. Units on one line are one layer in
# pipeline terms, but they are ordered here too, left to right, since they import each other one way.
ORDER = [
    "version", "errors",
    "families",  # the families' registry (names only) and their folders' packages: import nothing
    "runtime",  # what generated modules run: imports nothing of attngen; the planner shares its facts (shared.py)
    "ir", "intervals", "reference",  # the IR, its errors and its semantics
    "frontend",  # text -> Spec, and the checks of a spec's numbers
    "analysis",  # Spec -> Analysis
    "plan",  # Analysis -> Plan
    "emit",  # Analysis + Plan -> module source (the spec's kernels and declaration), and its bundle
    "cache", "report", "testing", "merge", "api", "flex",  # on top
    "distributed",  # context parallelism: builds the spec with global positions (api), merges (merge)
    "__init__", "bench", "hf", "cli",
]


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name, with whether it is a package (__init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


# A kernel family's folder holds one file per stage it takes part in, each in that stage's unit: its plan
# entry, its emit side, its host side and its device library (attngen/families/__init__.py says what each holds).
FAMILY_FILES = {"family": "plan", "emit": "emit", "runtime": "runtime", "device": "runtime"}


def _unit(module: str) -> str:
    """attngen.plan.planner -> plan; attngen.runtime.tables -> runtime; attngen.ir -> ir; attngen -> __init__;
    attngen.families.hopper.runtime -> runtime (a family's file, by its stage); attngen.families.hopper ->
    families."""
    parts = module.split(".")
    if parts[1:2] == ["families"] and len(parts) == 4:
        return FAMILY_FILES[parts[3]]
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(module: str, is_package: bool, node: ast.stmt) -> list[str]:
    """The attngen modules one import statement of `module` names (a module, else the package whose
    attribute it takes)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "attngen"]
    if node.level:  # relative: from the importer's package, one level up per extra dot
        base = module.split(".")[:len(module.split(".")) - node.level + is_package]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    if source.split(".")[0] != "attngen":
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]


def _edges() -> dict[tuple[str, str], int]:
    """(importer, imported) -> the line of one such import, for every import of attngen's own code."""
    edges = {}
    for module, (path, is_package) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(module, is_package, node):
                assert target in MODULES, f"{module} (line {node.lineno}) imports {target}, which does not exist"
                if target != module:
                    edges.setdefault((module, target), node.lineno)
                # The packages above the target run first; those above the importer have already started.
                parts = target.split(".")
                for depth in range(2, len(parts)):
                    package = ".".join(parts[:depth])
                    if package != module and not module.startswith(package + "."):
                        edges.setdefault((module, package), node.lineno)
    return edges


EDGES = _edges()


def _where(edge: tuple[str, str]) -> str:
    importer, imported = edge
    return f"{MODULES[importer][0].relative_to(PACKAGE.parent)}:{EDGES[edge]}: {importer} imports {imported}"


def test_the_graph_sees_every_form_of_import():
    tree = ast.parse("from . import x\nfrom .y import z\nfrom .. import ir\nimport attngen.a.b\n"
                     "def f():\n    from attngen.c import d\n")
    named = [t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _imported("attngen.emit.hooks", False, node)]
    assert named == ["attngen.emit", "attngen.emit.y", "attngen.ir", "attngen.a.b", "attngen.c"]
    assert _imported("attngen.emit", True, ast.parse("from . import hooks").body[0]) == ["attngen.emit.hooks"]
    # Lazy imports are edges too: api's are made inside functions.
    assert len(EDGES) > 100


def test_every_unit_is_placed_in_the_order():
    units = {_unit(m) for m in MODULES}
    assert units == set(ORDER), f"units not in ORDER (or gone): {sorted(units ^ set(ORDER))}"


def test_no_import_runs_against_the_order():
    wrong = [_where(e) for e in sorted(EDGES) if ORDER.index(_unit(e[1])) > ORDER.index(_unit(e[0]))]
    assert not wrong, "imports against the pipeline's order:\n" + "\n".join(wrong)


def test_no_import_cycle():
    graph: dict[str, list[str]] = {m: [] for m in MODULES}
    for importer, imported in sorted(EDGES):
        graph[importer].append(imported)
    # Depth-first search; a grey module met again closes a cycle, reported edge by edge.
    state, path = {}, []

    def visit(module: str) -> list[str] | None:
        state[module] = "grey"
        path.append(module)
        for target in graph[module]:
            if state.get(target) == "grey":
                cycle = path[path.index(target):] + [target]
                return [_where((a, b)) for a, b in zip(cycle, cycle[1:])]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = "black"
        return None

    for module in graph:
        if module not in state and (cycle := visit(module)):
            pytest.fail("an import cycle:\n" + "\n".join(cycle))


def test_the_report_layer_never_runs_the_pipeline():
    assert not [_where(e) for e in EDGES if _unit(e[0]) == "report" and _unit(e[1]) in ("api", "cache", "emit")]


def test_a_family_folder_holds_one_file_per_stage():
    from attngen import families

    folders = sorted(p.name for p in (PACKAGE / "families").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(families.FAMILIES), "every folder under attngen/families is registered, and only those"
    for name in families.FAMILIES:
        modules = {p.stem for p in (PACKAGE / "families" / name).glob("*.py")}
        # The device library is there only where the family's kernels share device code.
        assert {"__init__", *FAMILY_FILES} - {"device"} <= modules <= {"__init__", *FAMILY_FILES}, \
            f"attngen/families/{name}: {sorted(modules)}"
        assert (PACKAGE / "families" / name / "kernels.py.jinja").is_file(), name
