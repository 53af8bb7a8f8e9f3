"""The runtime (attngen/runtime/*.py and each family's runtime.py) is linted Python that imports only torch,
triton and itself; the
generated modules, thin and bundled, are linted Python that import what they promise; and the runtime
agrees with the package where the two share facts. No kernel runs.
"""

import ast
import itertools
import sys
from pathlib import Path

import pytest

# A static check of the sources: CI installs pyflakes (the dev extra); the GPU machine's image lacks it.
Checker = pytest.importorskip("pyflakes.checker").Checker

import attngen
from attngen import api, families, plan, testing
from attngen.emit import module as emit
from attngen.emit.families import emit_side
from attngen.runtime import facts, helpers, launch, shared

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attngen"
SPECS = sorted(ROOT.glob("specs/*.attn"))
ALLOWED_IMPORTS = sys.stdlib_module_names | {"torch", "triton"}


@pytest.fixture(scope="module")
def sources():
    return {path.stem: attngen.compile_source(path.read_text(), target="h200") for path in SPECS}


@pytest.fixture(scope="module")
def thin_sources():
    return {path.stem: attngen.compile_source(path.read_text(), target="h200", thin=True) for path in SPECS}


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


# What a bundle inlines (attngen.emit.bundle): the runtime package, and each family's runtime side with the
# packages above it.
RUNTIME = sorted([*(PACKAGE / "runtime").glob("*.py"), PACKAGE / "families" / "__init__.py",
                  *(PACKAGE / "families" / name / part for name in families.FAMILIES for part in ("__init__.py", "runtime.py"))])


def _runtime_id(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("path", RUNTIME, ids=_runtime_id)
def test_runtime_files_pass_pyflakes(path, monkeypatch):
    monkeypatch.delenv("PYFLAKES_BUILTINS", raising=False)
    assert not _flakes(path.read_text(), str(path))


@pytest.mark.parametrize("path", RUNTIME, ids=_runtime_id)
def test_runtime_files_import_only_torch_triton_and_their_own_package_relatively(path):
    # Relative imports only, so a bundle can serve the package under a private name, and only of files the
    # bundle holds (a family's runtime side never reaches its plan or emit side).
    tree = ast.parse(path.read_text())
    assert not any(isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("attngen")
                   for node in ast.walk(tree)), path.name
    assert {n.split(".")[0] for n in _absolute_imports(tree)} <= ALLOWED_IMPORTS, path.name
    bundled = {file.with_suffix("") if file.name != "__init__.py" else file.parent for file in RUNTIME}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base / node.module.replace(".", "/") if node.module else base
            assert target in bundled, f"{_runtime_id(path)}:{node.lineno} imports {target.relative_to(PACKAGE)}"


def _absolute_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_generated_modules_pass_pyflakes_with_no_builtins(path, sources, thin_sources, monkeypatch):
    monkeypatch.delenv("PYFLAKES_BUILTINS", raising=False)
    for source in (sources[path.stem], thin_sources[path.stem]):
        problems = _flakes(source, path.stem)
        assert not problems, "\n".join(map(str, problems))


def test_bundles_import_only_torch_triton_and_the_standard_library(sources):
    for name, source in sources.items():
        imported = {module for module in _absolute_imports(ast.parse(source))
                    if not module.startswith("_attngen_runtime_")}
        assert {module.split(".")[0] for module in imported} <= ALLOWED_IMPORTS, name


def test_thin_modules_import_the_runtime_and_no_other_attngen_code(thin_sources):
    for name, source in thin_sources.items():
        attngen_imports = {m for m in _absolute_imports(ast.parse(source)) if m.split(".")[0] == "attngen"}
        assert attngen_imports <= {"attngen.runtime.attention", "attngen.runtime.facts", "attngen.runtime.helpers",
                                   "attngen.runtime.kernels", *(f"attngen.families.{family}.{side}"
                                                                for family in families.FAMILIES
                                                                for side in ("runtime", "device"))}, name
        assert {"attngen.runtime.attention", "attngen.runtime.facts", "attngen.runtime.kernels"} <= attngen_imports, name


def test_modules_import_every_helper_the_runtime_offers_kernels():
    tree = ast.parse((PACKAGE / "runtime" / "helpers.py").read_text())
    assert sorted(_top_level_names(tree)) == sorted(emit.HELPER_NAMES)
    kernels = ast.parse((PACKAGE / "runtime" / "kernels.py").read_text())
    assert sorted(_top_level_names(kernels)) == sorted(emit.SHARED_KERNEL_NAMES)
    for family in families.FAMILIES:
        runtime = ast.parse((PACKAGE / "families" / family / "runtime.py").read_text())
        # A family's runtime holds no device code but the kernels it launches itself (no spec changes them):
        # those its own host code names as _launch's kernel.
        launched = {node.args[0].id for node in ast.walk(runtime) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name) and node.func.id == "_launch"
                    and node.args and isinstance(node.args[0], ast.Name)}
        assert set(_jitted(runtime)) <= launched, family
        # Its device library (device.py) offers a module's kernels the helpers it imports (DEVICE_HELPERS);
        # each of its other functions is one the library calls itself.
        helpers = emit_side(family).DEVICE_HELPERS
        path = PACKAGE / "families" / family / "device.py"
        device = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[], type_ignores=[])
        called = {node.id for function in device.body if isinstance(function, ast.FunctionDef)
                  for node in ast.walk(function) if isinstance(node, ast.Name) and node.id != function.name}
        assert set(helpers) <= set(_jitted(device)), family
        assert set(_jitted(device)) - set(helpers) <= called, family


def _jitted(tree: ast.Module) -> list[str]:
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.decorator_list
            and ast.unparse(node.decorator_list[0]) in ("gluon.jit", "triton.jit", "_gluon_builtin")]


@pytest.mark.parametrize("target", ["h200", "a100", "interpreter"])
@pytest.mark.parametrize("name", sorted(path.stem for path in (Path(__file__).parent.parent / "specs").glob("*.attn")))
def test_the_modules_shape_tables_are_the_plans(name, target):
    # The module writes its tile tables as rows over products of keys (emit.module._shape_rows): expanded
    # by the runtime, they are the planner's entries, key for key.
    attn = attngen.build(Path(__file__).parent.parent / "specs" / f"{name}.attn", target=target)
    entries = attn.plan.entries
    assert attn.module.FACTS.plan == {
        (e.head_dim_pad, e.head_dim_v_pad, e.dtype): tuple((t.block_m, t.block_n, t.num_warps, t.num_stages)
                                                           for t in (e.fwd, e.bwd_dkdv, e.bwd_dq)) for e in entries}
    assert attn.module.FACTS.family_tiles == {
        (e.head_dim_pad, e.head_dim_v_pad, e.dtype): {
            family: (t.block_m, t.block_n, t.num_warps, t.num_stages, t.buffers) for family, t in e.family_tiles}
        for e in entries if e.family_tiles}
    assert len(attn.module.FACTS.plan) == len(entries)


def test_a_shape_table_refuses_a_key_given_twice():
    with pytest.raises(ValueError, match="given twice"):
        facts.shape_table((((16,), (16, 32), ("f16",)), 1), (((16,), (32,), ("f16",)), 2))


@pytest.mark.parametrize("target", ["h200", "interpreter"])
def test_the_module_shares_the_package_facts(target):
    attn = attngen.build("attention plain\n", target=target)
    module = attn.module
    for d, dv in itertools.product(range(1, 257), repeat=2):
        assert module._widths(d, dv) == attn.plan.widths(d, dv), (d, dv)
    assert shared._INPUT_DTYPES == testing.TORCH_DTYPES
    assert tuple(shared._DTYPES.values()) == plan.DTYPES
    assert launch.INTERPRETING == api._interpreting()
    assert module.FACTS.tile_table is False
    assert isinstance(helpers.LOG2E.value, float)  # the host multiplies a float scale by it
