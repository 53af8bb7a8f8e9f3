"""The package's layout: stages import one way, down the pipeline, so no stage reaches into a later one
and nothing has an import cycle; the report layer never runs the pipeline (it never imports api)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"
# Each unit may import only units listed before it (and itself). emit/static/ comes first: the code that
# every generated module inlines, which imports only the standard library, torch and triton, and whose
# shared facts (tile widths, dtypes) the package imports so they are stated once. The frontend builds on
# the analysis: lowering checks a spec's numbers with its int ranges.
ORDER = ["emit.static", "version", "errors", "ir", "intervals", "reference", "analysis", "frontend", "plan", "emit", "report", "testing",
         "runtime", "merge", "api", "flex", "__init__", "bench", "hf", "cli"]
BACK_EDGES = set()


def _unit(module: str) -> str:
    """attngen.plan.planner -> plan; attngen.emit.static.shapes -> emit.static; attngen -> __init__."""
    parts = module.split(".")
    if parts[1:3] == ["emit", "static"]:
        return "emit.static"
    return parts[1] if len(parts) > 1 else "__init__"


def _imports():
    """(importing unit, imported module) for every import of attngen's own code, anywhere in a file."""
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "attngen":
                # `from attngen import x`: x is a unit of its own, or one of the package's public names.
                names = [node.module] if node.module != "attngen" else [
                    f"attngen.{a.name}" if a.name in ORDER else "attngen" for a in node.names]
                for name in names:
                    yield _unit(module), name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "attngen":
                        yield _unit(module), alias.name


def test_every_unit_is_placed_in_the_order():
    units = {_unit(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) for p in PACKAGE.glob("*.py")}
    units |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"emit.static"}
    assert units == set(ORDER), f"units not in ORDER (or gone): {sorted(units ^ set(ORDER))}"


def test_imports_run_one_way_down_the_pipeline():
    wrong = set()
    for source, target in _imports():
        target_unit = _unit(target)
        if ORDER.index(target_unit) > ORDER.index(source) and (source, target.removeprefix("attngen.")) not in BACK_EDGES:
            wrong.add(f"{source} imports {target}")
    assert not wrong, "imports against the pipeline's order:\n" + "\n".join(sorted(wrong))


def test_only_the_stated_back_edge_exists():
    found = {(s, t.removeprefix("attngen.")) for s, t in _imports()
             if ORDER.index(_unit(t)) > ORDER.index(s)}
    assert found == BACK_EDGES


def test_the_report_layer_never_runs_the_pipeline():
    assert not [t for s, t in _imports() if s == "report" and _unit(t) in ("api", "runtime", "emit")]
