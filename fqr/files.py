"""Writing the files a user sees: golden cases, their manifest and kernel sources, bench
documents and plots, ``fqr lower -o``. One rule for all of them: never through a symlink, never
half-written.

:func:`write_file` writes the bytes to a fresh file in the destination's directory (a random
name, created with ``O_EXCL | O_NOFOLLOW``), then renames it onto the destination
(``os.replace``: atomic, a reader sees the old file or the new one, and a rename replaces a
link rather than following it), the kernel cache's own write
(:func:`fqr.lowering.loader.replace_file_at`). A destination that already is a symlink is refused
(:class:`UnsafeDestination`, naming the path): writing through it would change a file
somewhere else (someone may have planted it in a shared directory), and replacing it would
silently change what the user put there. A directory is refused (``IsADirectoryError``), as
are a FIFO, a socket or a block device. A character device the user names (``/dev/null``) is
written in place: there is nothing there to replace. An existing file keeps its permission
bits. :func:`check_destination` gives the same refusals before any work (a command checks its
outputs before it measures or writes anything).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .lowering.loader import replace_file_at, write_all

_SYMLINK = (
    "a symlink (refused: fqr never writes through a symlink; remove it or choose another path)"
)


class UnsafeDestination(OSError):
    """A destination fqr will not write: a symlink, or a file that is not a regular file or a
    character device (``filename`` names it)."""


def _refusal(path: Path, st: os.stat_result | None) -> OSError | None:
    """Why ``path`` (whose ``lstat`` is ``st``; None: absent) cannot be written, or None."""
    if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        return UnsafeDestination(errno.ELOOP, _SYMLINK, str(path))
    if stat.S_ISDIR(st.st_mode):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    return UnsafeDestination(
        errno.EINVAL, "not a regular file (refused: fqr writes only regular files)", str(path)
    )


def _lstat(name: str, dfd: int | None = None) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def check_destination(path: Path | str) -> None:
    """Raise what :func:`write_file` would raise for ``path`` being a symlink, a directory or
    another file that is not regular (OSError naming the path); a missing file is fine."""
    path = Path(path)
    problem = _refusal(path, _lstat(str(path)))
    if problem is not None:
        raise problem


def write_file(path: Path | str, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically, never through a symlink.

    Raises OSError naming ``path``: :class:`UnsafeDestination` for a symlink (or a FIFO,
    socket, block device), ``IsADirectoryError``, and what the OS says (a missing directory,
    no space left, no permission)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    name = path.name
    if name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        st = _lstat(name, dfd)
        problem = _refusal(path, st)
        if problem is not None:
            raise problem
        if st is not None and stat.S_ISCHR(st.st_mode):
            _write_in_place(dfd, name, path, payload)
        else:
            _write_and_rename(dfd, name, path, payload, st)
    finally:
        os.close(dfd)


def _write_in_place(dfd: int, name: str, path: Path, payload: bytes) -> None:
    """Into a character device (``/dev/null``), opened without following a symlink."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeDestination(errno.ELOOP, _SYMLINK, str(path)) from None
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            raise UnsafeDestination(errno.EINVAL, "changed while fqr was writing it", str(path))
        write_all(fd, payload)
    except UnsafeDestination:
        raise
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def _write_and_rename(
    dfd: int, name: str, path: Path, payload: bytes, st: os.stat_result | None
) -> None:
    """A fresh file beside the destination (``O_EXCL``: never an existing one), then a rename
    onto it; an existing file's permission bits are kept."""
    try:
        replace_file_at(
            dfd,
            name,
            payload,
            mode=0o666,  # the umask applies, as to any new file
            chmod=None if st is None else stat.S_IMODE(st.st_mode),
        )
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def check_directory(path: Path | str) -> None:
    """Raise what :func:`make_directory` would raise for ``path`` (a symlink, or not a
    directory); a missing directory is fine."""
    path = Path(path)
    st = _lstat(str(path))
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise UnsafeDestination(errno.ELOOP, _SYMLINK, str(path))
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))


def make_directory(path: Path | str) -> None:
    """``mkdir -p path``, refusing a symlink at ``path`` itself (a directory fqr fills, such as
    the golden directory's ``kernels/``: a link planted there would send its files elsewhere)."""
    check_directory(path)
    Path(path).mkdir(parents=True, exist_ok=True)
