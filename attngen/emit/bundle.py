"""Bundles a generated module with attngen's runtime into one file that imports only torch and triton:
the spec's part first, then the runtime package's own files, verbatim, below a marker.

Each runtime file (attngen/runtime/*.py, and the runtime side of each family the module's plan names,
attngen/families/<name>/runtime.py and its device library device.py where it has one, with their packages) becomes a module of a private package whose name
carries a digest of their text (so a bundle never meets an installed attngen, nor a bundle of another
runtime), laid out as in attngen and served by a small import hook from the strings it is written in here;
the module's declaration then runs against it.
Only attngen's own files are inlined: the spec's text reaches a bundle only through the module, which
the emitter wrote (attngen.emit.module).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources

from attngen.emit.module import DECLARATION_MARKER, _with_digest, runtime_imports

RUNTIME_MARKER = ("# ---- attngen's runtime (attngen/runtime/*.py and its families' runtime.py and device.py), inlined from "
                  "here on ----\n")

# The hook that serves the private package from _RUNTIME_SOURCES. The text sits in linecache under the
# file name it is compiled with, so inspect.getsource (which triton.jit reads the helpers with) and
# tracebacks find it.
_INSTALLER = '''

def _install_runtime():
    import importlib.abc
    import importlib.util
    import linecache
    import sys

    class RuntimeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        package = _RUNTIME_PACKAGE

        def find_spec(self, name, path=None, target=None):
            package, _, part = name.partition(".")
            if package != self.package or (part and part not in _RUNTIME_SOURCES):
                return None
            return importlib.util.spec_from_loader(name, self, is_package=not part or _RUNTIME_SOURCES[part][1])

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            part = module.__name__.partition(".")[2]
            if not part:  # the package itself: only a name for its modules to live under
                return
            source, is_package = _RUNTIME_SOURCES[part]
            filename = f"{self.package}/{part.replace('.', '/')}{'/__init__' if is_package else ''}.py"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            exec(compile(source, filename, "exec"), module.__dict__)

    if not any(getattr(finder, "package", None) == _RUNTIME_PACKAGE for finder in sys.meta_path):
        sys.meta_path.append(RuntimeFinder())


_install_runtime()
'''


def _runtime_files(families: tuple[str, ...]) -> list[str]:
    """The modules, as paths in the package (runtime/checks.py), that a module of these families runs: the
    runtime package and the runtime side of each of its families, with the packages above them."""
    root = resources.files("attngen")
    files = sorted(f"runtime/{entry.name}" for entry in root.joinpath("runtime").iterdir() if entry.name.endswith(".py"))
    files.append("families/__init__.py")
    for name in families:
        files += [f"families/{name}/__init__.py", f"families/{name}/runtime.py"]
        if root.joinpath(f"families/{name}/device.py").is_file():
            files.append(f"families/{name}/device.py")
    return files


def _module_name(path: str) -> tuple[str, bool]:
    """A file's module name under the package (runtime.checks; families.hopper for its __init__.py) and
    whether it is a package."""
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts), parts[-1] == "__init__"


@lru_cache(maxsize=None)
def _source(path: str) -> str:
    text = resources.files("attngen").joinpath(path).read_text()
    # Each file is written as a raw ''' string: it must hold no ''' and no backslash before its end.
    assert "'''" not in text and not text.rstrip("\n").endswith("\\") and "\r" not in text, path
    return text


def bundle(module: str, families: tuple[str, ...]) -> str:
    """The standalone form of `module` (emit.module.render's text, of a plan with these families)."""
    imports = runtime_imports(module)
    assert module.count(imports) == 1 and module.count(DECLARATION_MARKER) == 1
    spec_part, _, declaration = module.replace(imports + "\n", "").partition(DECLARATION_MARKER)
    files = _runtime_files(families)
    digest = hashlib.sha256("\0".join(f"{path}\0{_source(path)}" for path in files).encode()).hexdigest()[:16]
    package = f"_attngen_runtime_{digest}"
    sources = "".join(f"    {_module_name(path)[0]!r}: (r'''{_source(path)}''', {_module_name(path)[1]}),\n"
                      for path in files)
    runtime = (f"{RUNTIME_MARKER}_RUNTIME_PACKAGE = {package!r}\n_RUNTIME_SOURCES = {{\n{sources}}}\n{_INSTALLER}\n"
               + imports.replace("from attngen.", f"from {package}."))
    # The module's digest (which names its custom operators) is taken again over the whole bundle.
    text = spec_part.rstrip("\n") + "\n\n\n" + runtime + "\n\n" + DECLARATION_MARKER + declaration
    return _with_digest(text.replace(_digest_line(text), 'MODULE_DIGEST = ""\n'))


def _digest_line(text: str) -> str:
    start = text.index("\nMODULE_DIGEST = ") + 1
    return text[start:text.index("\n", start) + 1]
