"""Bundles a generated module with attngen's runtime into one file that imports only torch and triton:
the spec's part first, then the runtime package's own files, verbatim, below a marker.

Each runtime file becomes a module of a private package whose name carries a digest of their text
(so a bundle never meets an installed attngen, nor a bundle of another runtime), served by a small
import hook from the string it is written in here; the module's declaration then runs against it.
Only attngen's own files are inlined: the spec's text reaches a bundle only through the module, which
the emitter wrote (attngen.emit.module).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources

from attngen.emit.module import DECLARATION_MARKER, _with_digest, runtime_imports
from attngen.runtime.families import FAMILIES

RUNTIME_MARKER = "# ---- attngen's runtime (attngen/runtime/*.py), inlined from here on ----\n"

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
            return importlib.util.spec_from_loader(name, self, is_package=not part)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            part = module.__name__.partition(".")[2] or "__init__"
            source, filename = _RUNTIME_SOURCES[part], f"{self.package}/{part}.py"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            exec(compile(source, filename, "exec"), module.__dict__)

    if not any(getattr(finder, "package", None) == _RUNTIME_PACKAGE for finder in sys.meta_path):
        sys.meta_path.append(RuntimeFinder())


_install_runtime()
'''


def _runtime_files(families: tuple[str, ...]) -> list[str]:
    """The runtime package's modules a module of these families runs: all but the other families'."""
    left_out = {module for name, (module, _) in FAMILIES.items() if name not in families}
    names = sorted(entry.name[:-3] for entry in resources.files("attngen.runtime").iterdir()
                   if entry.name.endswith(".py"))
    return [name for name in names if name not in left_out]


@lru_cache(maxsize=None)
def _source(name: str) -> str:
    text = resources.files("attngen.runtime").joinpath(f"{name}.py").read_text()
    # Each file is written as a raw ''' string: it must hold no ''' and no backslash before its end.
    assert "'''" not in text and not text.rstrip("\n").endswith("\\") and "\r" not in text, name
    return text


def bundle(module: str, families: tuple[str, ...]) -> str:
    """The standalone form of `module` (emit.module.render's text, of a plan with these families)."""
    imports = runtime_imports(module)
    assert module.count(imports) == 1 and module.count(DECLARATION_MARKER) == 1
    spec_part, _, declaration = module.replace(imports + "\n", "").partition(DECLARATION_MARKER)
    files = _runtime_files(families)
    digest = hashlib.sha256("\0".join(f"{name}\0{_source(name)}" for name in files).encode()).hexdigest()[:16]
    package = f"_attngen_runtime_{digest}"
    sources = "".join(f"    {name!r}: r'''{_source(name)}''',\n" for name in files)
    runtime = (f"{RUNTIME_MARKER}_RUNTIME_PACKAGE = {package!r}\n_RUNTIME_SOURCES = {{\n{sources}}}\n{_INSTALLER}\n"
               + imports.replace("from attngen.runtime.", f"from {package}."))
    # The module's digest (which names its custom operators) is taken again over the whole bundle.
    text = spec_part.rstrip("\n") + "\n\n\n" + runtime + "\n\n" + DECLARATION_MARKER + declaration
    return _with_digest(text.replace(_digest_line(text), 'MODULE_DIGEST = ""\n'))


def _digest_line(text: str) -> str:
    start = text.index("\nMODULE_DIGEST = ") + 1
    return text[start:text.index("\n", start) + 1]
