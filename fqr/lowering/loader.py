"""The kernel cache: generated sources are written to files, and the text fqr generated (never
anything read back) is what runs.

Triton needs a kernel's source (it reads it with :mod:`inspect`), so each generated kernel is a
file ``<cache>/fqr_<key>.py``; ``key`` hashes the program, the target, its tiling, the emitter
version and the installed triton version, so a second process finds and reuses it. The
directory is ``$FQR_CACHE_DIR`` or ``kernels`` under ``platformdirs.user_cache_dir("fqr")``
(``$XDG_CACHE_HOME/fqr/kernels``, by default ``~/.cache/fqr/kernels``, on Linux).

Code fqr writes and later runs must never be code someone else could plant:

* the directory must be owned by this user and writable by nobody else (else
  :class:`KernelCacheError`); a missing one is created private (0700), and the default one,
  fqr's own, is made private again if an older fqr left it group-writable;
* an entry is used only when its bytes equal the generated source; a missing, corrupt,
  stale or symlinked entry is rewritten atomically (a directory there is an error: fqr does
  not delete what it did not write);
* the module is compiled from the generated text itself (``compile(text, path)`` into a fresh
  module; the import machinery, which honours ``__pycache__/*.pyc`` files whose header
  matches the ``.py``, is never used), and :mod:`linecache` holds that same text for
  ``path``, so Triton's :func:`inspect.getsource` reads what was compiled, not the file.

Interpreted kernels come back wrapped so that their launches hold :data:`INTERPRETER_LOCK`:
Triton's interpreter patches ``triton.language`` and the kernel's globals during a launch, so
two threads interpreting at once break each other.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata as md
import linecache
import logging
import os
import secrets
import stat
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
INTERPRETER_LOCK = threading.Lock()
_LOAD_LOCK = threading.Lock()
_LOADED: dict[tuple[str, bool], LoadedKernel] = {}


class KernelCacheError(OSError):
    """The kernel cache directory or an entry in it cannot be used; the message names the path
    and what to do."""


@dataclass(frozen=True)
class LoadedKernel:
    fn: Any  # the @triton.jit function (serialised launches when interpreted)
    path: Path
    cache_hit: bool  # the entry on disk already held exactly this source


def _cache_location() -> tuple[Path, str, bool]:
    """The cache directory, how to name it in messages, and whether the user chose it."""
    env = os.environ.get("FQR_CACHE_DIR")
    if env:
        return Path(env), f"FQR_CACHE_DIR={env}", True
    import platformdirs

    d = Path(platformdirs.user_cache_dir("fqr")) / "kernels"
    return d, f"the kernel cache {d}", False


def cache_dir() -> Path:
    """The kernel cache directory (created private when missing; not checked here)."""
    return _cache_location()[0]


def directory_problem(st: os.stat_result) -> str | None:
    """Why a directory (its ``os.fstat``) cannot hold code fqr runs: not owned by this user, or
    writable by others; None when it can."""
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _open_cache_dir() -> tuple[int, Path]:
    """An fd of the checked cache directory (every entry is opened relative to it, so the
    directory checked is the directory used) and its path."""
    d, named, chosen = _cache_location()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise KernelCacheError(
            f"{named}: not a directory (point FQR_CACHE_DIR at a directory)"
        ) from None
    except OSError as e:
        raise KernelCacheError(
            f"{named}: cannot use it as the kernel cache: {e.strerror}"
        ) from None
    st = os.fstat(dfd)
    problem = directory_problem(st)
    if problem and st.st_uid == os.geteuid() and not chosen:
        # fqr's own default directory, made group-writable by an older fqr under umask 002:
        # fqr tightens it (entries are checked byte for byte before use anyway).
        os.fchmod(dfd, 0o700)
        log.warning("made the kernel cache %s private (it was mode %04o)", d, st.st_mode & 0o777)
        problem = None
    if problem:
        os.close(dfd)
        raise KernelCacheError(
            f"{named} {problem}: whoever can write there can run code in fqr's processes; use "
            f"a directory only you can write (chmod go-w), or unset FQR_CACHE_DIR",
        )
    return dfd, d


def _entry_matches(dfd: int, name: str, path: Path, expected: bytes) -> bool:
    """True when the entry is a regular file of ours holding exactly ``expected``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: not a file fqr wrote; replaced below
            return False
        raise KernelCacheError(f"kernel cache entry {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise KernelCacheError(
                f"kernel cache entry {path} is a directory, not a kernel source file; remove it",
            )
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        chunks, left = [], len(expected) + 1  # never read more than a match needs
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks) == expected
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file_at(
    dfd: int, name: str, data: bytes, *, mode: int, chmod: int | None = None, sync: bool = True
) -> None:
    """Replace the file ``name`` in the directory open as ``dfd`` by ``data``, atomically and
    never through a symlink (the kernel cache's entries, and every file :mod:`fqr.files`
    writes).

    The bytes go to a fresh file beside it (a random name opened with ``O_EXCL | O_NOFOLLOW``:
    never an existing file, never a link), created with ``mode`` under the umask (``chmod``:
    these permission bits exactly, e.g. the replaced file's), written in full and synced, then
    renamed onto ``name`` (``os.replace``: a reader sees the old file or the new one, and a
    link there is replaced rather than followed). On failure the fresh file is removed and the
    OS's error raised (``FileExistsError`` when no fresh name was found). ``sync=False`` skips
    the ``fsync`` for a file whose every reader checks its bytes (a kernel cache entry: one a
    crash tore is found unequal and written again)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        # at most 22 more bytes than a short stem: a long destination name still fits NAME_MAX
        tmp = f".{name[:32]}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dfd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no fresh temporary name beside it")
    try:
        try:
            if chmod is not None:
                os.fchmod(fd, chmod)
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise


def _write_entry(dfd: int, name: str, path: Path, data: bytes) -> None:
    """Atomically replace the entry (concurrent writers of one key agree on the bytes); not
    synced to disk: :func:`load_kernel` compares an entry's bytes before using it, so one torn
    by a crash is rewritten (the fsync cost a first call a few ms, issue 37)."""
    try:
        replace_file_at(dfd, name, data, mode=0o600, sync=False)
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise KernelCacheError(
                f"kernel cache entry {path} is a directory, not a kernel source file; remove it",
            ) from None
        raise KernelCacheError(
            f"cannot write the kernel cache entry {path}: {e.strerror}"
        ) from None


def load_kernel(key: str, source: str, kernel_name: str, *, interpret: bool) -> LoadedKernel:
    """The kernel ``kernel_name`` defined by ``source``, cached as ``fqr_<key>.py``.

    ``interpret`` decorates it for Triton's interpreter (launches serialised). Raises
    :class:`KernelCacheError` naming the path when the cache cannot be used safely.
    """
    with _LOAD_LOCK:
        loaded = _LOADED.get((key, interpret))
        if loaded is not None:
            return loaded
        name = f"fqr_{key}.py"
        dfd, directory = _open_cache_dir()
        path = directory / name
        try:
            data = source.encode()
            hit = _entry_matches(dfd, name, path, data)
            if not hit:
                _write_entry(dfd, name, path, data)
        finally:
            os.close(dfd)
        log.debug("kernel cache %s: %s", "hit" if hit else "miss, written", path)
        require_triton_mode(interpret)
        fn = _exec_source(source, path, kernel_name, interpret)
        loaded = _LOADED[(key, interpret)] = LoadedKernel(
            SerialisedLaunches(fn) if interpret else fn, path, hit
        )
        return loaded


def _exec_source(source: str, path: Path, kernel_name: str, interpret: bool) -> Any:
    """Compile ``source`` (the generated text, not the file) into a fresh module; ``path`` is
    its file name, and linecache serves ``source`` for it."""
    mod_name = f"fqr_kernels.{path.stem}{'_interpret' if interpret else ''}"
    module = types.ModuleType(mod_name)
    module.__file__ = str(path)
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    code = compile(source, str(path), "exec", dont_inherit=True)
    sys.modules[mod_name] = module  # as an import would: inspect.getmodule finds it
    exec(code, module.__dict__)
    return getattr(module, kernel_name)


class SerialisedLaunches:
    """An interpreted kernel whose launches (``fn[grid](...)``) hold :data:`INTERPRETER_LOCK`;
    every other attribute is the kernel's own."""

    def __init__(self, fn: Any):
        self._fn = fn

    def __getitem__(self, grid):
        launch = self._fn[grid]

        def locked(*args, **kwargs):
            with INTERPRETER_LOCK:
                return launch(*args, **kwargs)

        return locked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def triton_version() -> str:
    for dist in ("triton", "triton-ascend"):
        try:
            return f"{dist}-{md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "none"


def cache_key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts + (triton_version(),):
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def triton_mode() -> str:
    """How this process's triton runs kernels: ``unloaded``, ``interpreted`` or ``compiled``.

    Triton decorates its own library functions (``tl.sum`` ...) when ``triton.language`` is first
    imported, reading ``TRITON_INTERPRET`` then; so one process is either interpreted or
    compiled for good.
    """
    lang = sys.modules.get("triton.language")
    if lang is None:
        return "unloaded"
    return "interpreted" if type(lang.sum).__name__ == "InterpretedFunction" else "compiled"


def require_triton_mode(interpret: bool) -> None:
    mode = triton_mode()
    want = "interpreted" if interpret else "compiled"
    if mode not in ("unloaded", want):
        raise RuntimeError(
            f"triton is already loaded {mode} in this process; the "
            f"{'interpreter' if interpret else 'compiled'} backends need a process of their own "
            f"(set TRITON_INTERPRET={'1' if interpret else '0'} before triton is imported)"
        )
    if mode == "unloaded":
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
