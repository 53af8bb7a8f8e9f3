"""Writes a rendered kernel module to the on-disk cache and imports it, keyed by fingerprint."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Callable

from attngen import __version__

_LOADED: dict[Path, ModuleType] = {}


def cache_dir() -> Path:
    """Where generated modules live: $ATTNGEN_CACHE_DIR, else ~/.cache/attngen."""
    root = os.environ.get("ATTNGEN_CACHE_DIR") or Path.home() / ".cache" / "attngen"
    return Path(root)


def _templates_digest() -> str:
    digest = hashlib.sha256()
    for entry in sorted(resources.files("attngen").joinpath("templates").iterdir(), key=lambda e: e.name):
        digest.update(entry.name.encode() + entry.read_bytes())
    return digest.hexdigest()


def module_key(*parts: str) -> str:
    """A cache key over the given parts, attngen's version and the templates."""
    text = "\0".join((__version__, _templates_digest(), *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load(name: str, key: str, render: Callable[[], str]) -> tuple[ModuleType, Path]:
    """Import the module cached under `key`, rendering and writing it first if it is not there."""
    path = cache_dir() / f"{name}_{key}.py"
    if path in _LOADED:
        return _LOADED[path], path
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent process never imports a half-written file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(render())
        os.replace(tmp, path)
    if os.environ.get("ATTNGEN_DEBUG") == "1":
        print(f"attngen: {name} kernels at {path}", file=sys.stderr)
    module_name = f"attngen_generated.{name}_{key}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _LOADED[path] = module
    return module, path
