"""Keeps rendered kernel modules in an on-disk cache and imports them, never a file it did not write.

The key of a cached module covers everything its text depends on (`module_key`): the spec's IR
and source text, its params (in the IR), the plan, every file of attngen's own code, and the
torch and triton versions. So a spec of the same name but other text, or a changed attngen,
gets a module of its own. Each file ends with a seal, an HMAC-SHA256 of its name and everything
above that line under a per-user key kept outside the cache (`key_path`); a file whose seal does
not match (edited, truncated, planted, moved from another name) or that is a symlink is rebuilt,
with a warning that names it, and what runs is the text that was verified, read once. A cache
directory or key that someone else could write (or read, for the key) is refused with one warning,
for a private directory of this process. docs/api.md states the threat model.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import linecache
import os
import re
import secrets
import stat
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

from attngen.errors import ArgumentError
from attngen.ir import name_problem
from attngen.version import __version__

_LOADED: dict[Path, ModuleType] = {}
_SEAL_PREFIX = "# attngen cache seal: hmac-sha256 "
_FALLBACK: list[Path] = []  # the per-process directory used when the cache directory or the key is unusable
_SECRET: list[bytes] = []  # the seal key, read once per process
_KEY_FOLDER: list[int] = []  # [device, inode] of the key's folder, which the cache must not be


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


class _Refused(Exception):
    """A folder or file attngen does not trust: someone else could have written (or read) it. The
    message says why, as a predicate ("is a symbolic link")."""


class _RefusedFolder(_Refused):
    """The key's folder is refused, not the key."""


def _why(e: Exception) -> str:
    return f"it {e}" if isinstance(e, _Refused) else str(e)


# Refuse to follow a symlink where the platform can (every POSIX system).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KEY_BYTES = 32


def _trust_problem(st: os.stat_result, private: bool = False) -> str | None:
    """Why a folder or file with this stat could hold what someone else wrote (or, if `private`,
    could be read by someone else), or None."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes to check
        return None
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        return f"has mode {mode:o}, which lets others read it (it must be 600)"
    if mode & 0o022:
        return f"is writable by group or others (mode {mode:o}; chmod go-w fixes it)"
    return None


def _make_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 whatever the umask (Path.mkdir gives the
    parents the umask's mode)."""
    if path.is_dir():
        return
    if path.parent != path:
        _make_dirs(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # another process made it, or a file is in the way, which opening it reports


def _open_dir(path: Path) -> int:
    """An open descriptor of folder `path` (created if need be), which the current user owns and no
    one else can write. Every later read and write goes through the descriptor, so swapping the path
    for another folder after this check changes nothing; a symlink to a folder is followed, and what
    is checked is the folder it reaches."""
    _make_dirs(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        problem = _trust_problem(os.fstat(fd))
        if problem:
            raise _Refused(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(folder: int, filename: str, private: bool = False) -> bytes:
    """The bytes of `filename` in `folder`, read once from a regular file, not a symlink (and, if
    `private`, one the current user owns and no one else can read)."""
    try:
        fd = os.open(filename, os.O_RDONLY | _NOFOLLOW, dir_fd=folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Refused("is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("is not a regular file")
        problem = _trust_problem(st, private=True) if private else None
        if problem:
            raise _Refused(problem)
        return f.read()


def _write(folder: int, filename: str, data: bytes) -> None:
    """Write `filename` in `folder`, mode 0600, atomically: a fresh file (O_EXCL, never a symlink),
    renamed over the name, so a concurrent process never reads a half-written one."""
    tmp = f".{filename}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, filename, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def key_path() -> Path:
    """Where this user's seal key lives: $XDG_CONFIG_HOME/attngen/seal.key, else
    ~/.config/attngen/seal.key; apart from the cache, so sharing or copying the cache gives no one
    the key."""
    root = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(root) / "attngen" / "seal.key"


def _read_key() -> tuple[bytes, list[int]]:
    """This user's seal key, created (random, 0600) if there is none yet, and the (device, inode) of
    its folder."""
    path = key_path()
    try:
        folder = _open_dir(path.parent)
    except _Refused as e:
        raise _RefusedFolder(f"is in a folder that {e}") from None
    try:
        try:
            key = _read(folder, path.name, private=True)
        except FileNotFoundError:
            # Write a whole key under a fresh name, then link it in: link never replaces, so of
            # processes racing here one key wins, and every one of them reads it whole.
            tmp = f".{path.name}.{secrets.token_hex(8)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(_KEY_BYTES))
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            finally:
                os.unlink(tmp, dir_fd=folder)
            key = _read(folder, path.name, private=True)
        if len(key) != _KEY_BYTES:
            raise _Refused(f"holds {len(key)} bytes, not {_KEY_BYTES}")
        st = os.fstat(folder)
        return key, [st.st_dev, st.st_ino]
    finally:
        os.close(folder)


_DIRECTORY_ADVICE = "set ATTNGEN_CACHE_DIR to a directory that you own and no one else can write"


def _fall_back(message: str, advice: str = _DIRECTORY_ADVICE) -> Path:
    """The per-process private directory (mkdtemp: 0700) used when the cache directory or the key
    cannot be trusted, announced once: `message` says what failed and why."""
    if not _FALLBACK:
        _FALLBACK.append(Path(tempfile.mkdtemp(prefix="attngen-")))
        warnings.warn(f"attngen: {message}; using {_FALLBACK[0]} for this process ({advice})", RuntimeWarning,
                      stacklevel=4)
    return _FALLBACK[0]


def _secret() -> bytes:
    """The key that seals this process's modules: the user's (key_path), else, if it cannot be
    trusted, a random one of this process's own, with the per-process cache directory."""
    if not _SECRET:
        try:
            key, folder = _read_key()
            _KEY_FOLDER[:] = folder
        except (OSError, _Refused) as e:
            key = secrets.token_bytes(_KEY_BYTES)
            _fall_back(f"cannot use the seal key {key_path()} ({_why(e)}); sealing with a key of this process's "
                       f"own", "make its folder yours, mode 700" if isinstance(e, _RefusedFolder) else
                       "delete the key file and attngen writes a new one")
        _SECRET.append(key)
    return _SECRET[0]


def _seal(filename: str, body: bytes) -> bytes:
    """The last line of cached module `filename` whose text above it is `body`: an HMAC of both under
    the user's key, so no one without the key can seal a file, nor move a sealed one to another name."""
    digest = hmac.new(_secret(), filename.encode() + b"\0" + body, hashlib.sha256).hexdigest()
    return f"{_SEAL_PREFIX}{digest}\n".encode()


def _sealed_body(filename: str, data: bytes) -> bool:
    """Whether `data` ends with the seal of `filename` and everything above it."""
    body, _, last = data.rstrip(b"\n").rpartition(b"\n")
    return bool(body) and hmac.compare_digest(_seal(filename, body + b"\n"), last + b"\n")


def _cache_folder() -> tuple[Path, int]:
    """The cache directory to use and an open descriptor of it: cache_dir(), unless this process fell
    back, or falls back now (it cannot be created or opened, someone else could write it, or it is
    the key's folder)."""
    if not _FALLBACK:
        try:
            folder = _open_dir(cache_dir())
        except (OSError, _Refused) as e:
            _fall_back(f"cannot write kernel modules to the cache directory {cache_dir()} ({_why(e)})")
        else:
            st = os.fstat(folder)
            if [st.st_dev, st.st_ino] != _KEY_FOLDER:
                return cache_dir(), folder
            os.close(folder)
            _fall_back(f"cannot write kernel modules to the cache directory {cache_dir()} (it holds "
                       f"attngen's seal key, which must stay out of the cache)")
    return _FALLBACK[0], _open_dir(_FALLBACK[0])


def _cached_text(name: str, key: str, render: Callable[[], str]) -> tuple[Path, str]:
    """The path and the verified text of the module for `key`: read once from the cache if attngen
    sealed it there for this name, else rendered and written (with a warning naming a file that was
    there but not sealed)."""
    _secret()  # first, so a key that cannot be trusted moves the cache to the per-process directory
    filename = f"{name}_{key}.py"
    directory, folder = _cache_folder()
    path = directory / filename
    try:
        try:
            data = _read(folder, filename)
            if _sealed_body(filename, data):
                return path, data.decode()
            why = "does not match its seal (edited, truncated, damaged or not written by attngen)"
        except FileNotFoundError:
            why = None
        except (OSError, _Refused) as e:
            why = f"{e}, not a file attngen wrote" if isinstance(e, _Refused) else f"cannot be read ({e})"
        if why:
            warnings.warn(f"attngen: the cached kernel module {path} {why}; rebuilding it", RuntimeWarning,
                          stacklevel=4)
        body = render().encode()
        body = body if body.endswith(b"\n") else body + b"\n"  # the seal is a line of its own
        data = body + _seal(filename, body)
        try:
            _write(folder, filename, data)
        except OSError as e:
            os.close(folder)
            folder = -1
            if _FALLBACK:
                raise
            directory = _fall_back(f"cannot write kernel modules to the cache directory {cache_dir()} ({e})")
            path = directory / filename
            folder = _open_dir(directory)
            _write(folder, filename, data)
        return path, data.decode()
    finally:
        if folder >= 0:
            os.close(folder)


def load(name: str, key: str, render: Callable[[], str]) -> tuple[ModuleType, Path]:
    """Import the module cached under `key`, rendering and writing it first if it is not there sealed.

    The bytes read and verified are the bytes run: they are compiled here, not imported from the
    path, and put in linecache, where Triton reads its kernels' source, so a file changed after the
    check is never run.
    """
    # Both make the file name: a bad one could point anywhere, so they are checked, with no assert.
    problem = name_problem(name, declared=False)
    if problem:
        raise ArgumentError(f"name must be a spec name, got {name!r} ({problem})")
    if not (isinstance(key, str) and re.fullmatch(r"[0-9a-f]{24}", key)):
        raise ArgumentError(f"key must be 24 hex digits (runtime.module_key), got {key!r}")
    loaded = (_FALLBACK[0] if _FALLBACK else cache_dir()) / f"{name}_{key}.py"
    if loaded in _LOADED:  # built before in this process
        return _LOADED[loaded], loaded
    path, text = _cached_text(name, key, render)
    if os.environ.get("ATTNGEN_DEBUG") == "1":
        print(f"attngen: {name} kernels at {path}", file=sys.stderr)
    module_name = f"attngen_generated.{name}_{key}"
    module = ModuleType(module_name)
    module.__file__ = str(path)
    # A (size, None, lines, path) entry is never checked against the disk (linecache.checkcache).
    linecache.cache[str(path)] = (len(text), None, text.splitlines(keepends=True), str(path))
    code = compile(text, str(path), "exec", dont_inherit=True)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    _LOADED[path] = module
    return module, path
