"""attngen: compile attention variants written in a small language into fused Triton kernels."""

import importlib as _importlib
import os as _os
import sys as _sys
import types as _types

from attngen.version import __version__

# The public names, each from the module that defines it. They load on first use, so that the
# command line's help and spec errors do not wait seconds for torch and triton.
_PUBLIC = {"Attention": "attngen.api", "build": "attngen.api", "compile_source": "attngen.api",
           "load_spec": "attngen.api", "parse_spec": "attngen.api", "ArgumentError": "attngen.errors",
           "SpecError": "attngen.errors", "to_flex": "attngen.flex", "Spec": "attngen.ir", "merge": "attngen.merge",
           "with_params": "attngen.api"}


def _interpret_without_gpu() -> None:
    # Triton picks compiled or interpreted kernels when it is first imported, so a machine
    # with no CUDA GPU must ask for the interpreter before anything imports triton.
    if "TRITON_INTERPRET" not in _os.environ:
        import torch

        if not torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"


class _BeforeTriton:
    """Decides TRITON_INTERPRET when triton is first imported, by attngen or anything else after it,
    rather than when attngen is: asking torch whether there is a GPU takes seconds."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "triton":
            _sys.meta_path.remove(_BeforeTriton)
            _interpret_without_gpu()
        return None  # the ordinary finders import it


if "triton" in _sys.modules:  # too late to choose; api.interpreter_problem says so when it matters
    _interpret_without_gpu()
elif _BeforeTriton not in _sys.meta_path:
    _sys.meta_path.insert(0, _BeforeTriton)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'attngen' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])


class _Package(_types.ModuleType):
    """The package itself. A submodule's first import binds it on the package under its name, and one public
    name is also a submodule's (attngen.merge, the function, in attngen/merge.py): the function keeps the name."""

    def __setattr__(self, name, value):
        if isinstance(value, _types.ModuleType) and _PUBLIC.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__all__ = ["Attention", "ArgumentError", "Spec", "SpecError", "build", "compile_source", "merge",
           "load_spec", "parse_spec", "to_flex", "with_params", "__version__"]
