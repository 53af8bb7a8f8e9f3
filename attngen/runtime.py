"""Keeps rendered kernel modules in an on-disk cache and imports them, never a file it did not write.

The key of a cached module covers everything its text depends on (`module_key`): the spec's IR
and source text, its params (in the IR), the plan, every file of attngen's own code, and the
torch and triton versions. So a spec of the same name but other text, or a changed attngen,
gets a module of its own. Each file ends with the SHA-256 of everything above that line; a file
whose content does not match it (edited, truncated, damaged) is rebuilt, with a warning that
names it, before anything imports it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import triton

from attngen.version import __version__

_LOADED: dict[Path, ModuleType] = {}
_SEAL_PREFIX = "# attngen cache seal: sha256 "
_FALLBACK: list[Path] = []  # the per-process directory used when the cache directory is unusable


def cache_dir() -> Path:
    """Where generated modules live: $ATTNGEN_CACHE_DIR, else ~/.cache/attngen."""
    root = os.environ.get("ATTNGEN_CACHE_DIR") or Path.home() / ".cache" / "attngen"
    return Path(root)


@lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of attngen's own code: every module, template and grammar file of the package, so an
    edited (editable-install) attngen never reuses modules rendered by its earlier self."""
    digest = hashlib.sha256()
    package = resources.files("attngen")
    pending = [(package, "")]
    files = []
    while pending:
        folder, prefix = pending.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if entry.name != "__pycache__":
                    pending.append((entry, f"{prefix}{entry.name}/"))
            elif entry.name.endswith((".py", ".jinja", ".lark")):
                files.append((f"{prefix}{entry.name}", entry))
    for name, entry in sorted(files, key=lambda f: f[0]):
        digest.update(name.encode() + b"\0" + entry.read_bytes() + b"\0")
    return digest.hexdigest()


def module_key(*parts: str) -> str:
    """A cache key over the given parts (the spec's IR and text, the plan), attngen's code and the
    torch and triton versions."""
    text = "\0".join((__version__, code_digest(), torch.__version__, triton.__version__, *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _seal(source: str) -> str:
    return f"{_SEAL_PREFIX}{hashlib.sha256(source.encode()).hexdigest()}\n"


def _intact(path: Path) -> bool:
    """Whether the file ends with the seal of everything above it."""
    try:
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError):
        return False
    body, _, last = text.rstrip("\n").rpartition("\n")
    return last.startswith(_SEAL_PREFIX) and _seal(body + "\n") == last + "\n"


def _write(path: Path, source: str) -> None:
    source = source if source.endswith("\n") else source + "\n"  # the seal is a line of its own
    # Write then rename, so a concurrent process never imports a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source + _seal(source))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fallback_dir(reason: OSError) -> Path:
    """A per-process temporary directory, announced once, for when the cache directory is unusable."""
    if not _FALLBACK:
        _FALLBACK.append(Path(tempfile.mkdtemp(prefix="attngen-")))
        warnings.warn(f"attngen: cannot write kernel modules to the cache directory {cache_dir()} ({reason}); "
                      f"using {_FALLBACK[0]} for this process (set ATTNGEN_CACHE_DIR to a writable directory)",
                      RuntimeWarning, stacklevel=3)
    return _FALLBACK[0]


def _cached_file(name: str, key: str, render: Callable[[], str]) -> Path:
    """The path of an intact module for `key`, rendering and writing it first if need be (a module
    this process already imported is not read again)."""
    filename = f"{name}_{key}.py"
    path = (_FALLBACK[0] if _FALLBACK else cache_dir()) / filename
    if path in _LOADED:
        return path
    if path.exists():
        if _intact(path):
            return path
        warnings.warn(f"attngen: the cached kernel module {path} does not match its seal (edited, truncated "
                      f"or damaged); rebuilding it", RuntimeWarning, stacklevel=3)
    source = render()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, source)
    except OSError as e:
        path = _fallback_dir(e) / filename
        _write(path, source)
    return path


def load(name: str, key: str, render: Callable[[], str]) -> tuple[ModuleType, Path]:
    """Import the module cached under `key`, rendering and writing it first if it is not there intact.

    `name` is an IR-validated identifier (ir.name_problem) and `key` a hex digest, so the file
    name can only fall inside the cache directory.
    """
    assert name.isidentifier() and all(c in "0123456789abcdef" for c in key), (name, key)
    path = _cached_file(name, key, render)
    if path in _LOADED:  # built before in this process
        return _LOADED[path], path
    if os.environ.get("ATTNGEN_DEBUG") == "1":
        print(f"attngen: {name} kernels at {path}", file=sys.stderr)
    module_name = f"attngen_generated.{name}_{key}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _LOADED[path] = module
    return module, path
