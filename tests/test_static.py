"""The generated module's static code (attngen/plan/shared.py, attngen/emit/static/*.py) is linted Python,
inlined verbatim, and agrees with the package where the two share facts; no kernel runs.

The static files read the names a module's preamble and kernel templates define; pyflakes takes those
as builtins there (attngen.emit.module.LINT_BUILTINS). From the command line:

    PYFLAKES_BUILTINS=$(python -c "import attngen.emit.module as m; print(','.join(m.LINT_BUILTINS))") \\
        python -m pyflakes attngen/plan/shared.py attngen/emit/static
"""

import ast
import itertools
import re
import sys
from pathlib import Path

import pytest
from pyflakes.checker import Checker

import attngen
from attngen import api, plan, testing
from attngen.emit import module as emit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attngen"
SPECS = sorted(ROOT.glob("specs/*.attn"))
ALLOWED_IMPORTS = sys.stdlib_module_names | {"torch", "triton"}


@pytest.fixture(scope="module")
def sources():
    return {path.stem: attngen.compile_source(path.read_text(), target="h200") for path in SPECS}


def _flakes(text: str, filename: str, builtins=()) -> list:
    return Checker(ast.parse(text), filename, builtins=set(builtins)).messages


def _top_level_names(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    return names


def _imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted({*(PACKAGE / "emit" / "static").glob("*.py"), PACKAGE / "plan" / "shared.py"}),
                         ids=lambda p: p.name)
def test_static_files_pass_pyflakes(path, monkeypatch):
    monkeypatch.delenv("PYFLAKES_BUILTINS", raising=False)
    assert not _flakes(path.read_text(), str(path), emit.LINT_BUILTINS)


def test_static_files_are_inlined_verbatim_from_their_marker(sources):
    for name in emit.STATIC_FILES:
        text = (PACKAGE / emit.STATIC_PATHS[name]).read_text()
        assert text.count(emit.INLINE_MARKER) == 1, name
        code = emit.static_code(name)
        assert text.endswith(code + "\n") and code.strip(), name
        for source in sources.values():
            # The one line the emitter fills in: the digest that names the module's operators.
            unfilled = re.sub(r'\nMODULE_DIGEST = "[0-9a-f]{16}"\n', '\nMODULE_DIGEST = ""\n', source)
            assert unfilled.count(code) == 1, name


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_generated_module_passes_pyflakes_with_no_builtins(path, sources, monkeypatch):
    monkeypatch.delenv("PYFLAKES_BUILTINS", raising=False)
    source = sources[path.stem]
    problems = _flakes(source, path.stem)
    assert not problems, "\n".join(map(str, problems))


def test_generated_modules_import_only_torch_triton_and_the_standard_library(sources):
    for name, source in sources.items():
        assert _imported_modules(ast.parse(source)) <= ALLOWED_IMPORTS, name
    # The package imports shared.py itself, so all of it (not only its inlined code) must be standalone.
    assert _imported_modules(ast.parse((PACKAGE / "plan" / "shared.py").read_text())) <= ALLOWED_IMPORTS


def test_preamble_defines_exactly_the_preamble_names(sources):
    for name, source in sources.items():
        preamble = ast.parse(source[:source.index(emit.static_code(emit.STATIC_FILES[0]))])
        assert sorted(_top_level_names(preamble)) == sorted(emit.PREAMBLE_NAMES), name


def test_every_lint_builtin_is_defined_by_every_module(sources):
    """A name in LINT_BUILTINS that some module does not define would hide an undefined name in the
    static code; the table kernels of a spec without tile tables are defined as None."""
    for name, source in sources.items():
        assert set(emit.LINT_BUILTINS) <= set(_top_level_names(ast.parse(source))), name


@pytest.mark.parametrize("target", ["h200", "interpreter"])
def test_the_module_shares_the_package_facts(target):
    attn = attngen.build("attention plain\n", target=target)
    module = attn.module
    for d, dv in itertools.product(range(1, 257), repeat=2):
        assert module._widths(d, dv) == attn.plan.widths(d, dv), (d, dv)
    assert module._INPUT_DTYPES == testing.TORCH_DTYPES
    assert tuple(module._DTYPES.values()) == plan.DTYPES
    assert module.INTERPRETING == api._interpreting()
    assert isinstance(module.TILE_TABLE, module.tl.constexpr) and not module.TILE_TABLE
    assert isinstance(module.LOG2E.value, float)  # the host multiplies a float scale by it
