"""Kernel bundles: fqr's kernels compiled ahead of time for a named GPU, loaded with no compile.

A JIT-compiled kernel costs its first call about a second (Triton: TTIR -> TTGIR -> LLVM ->
PTX -> cubin); a serving process pays it for every preset, TP size, dtype and token bucket it
meets, and a GPU test visit for every case. None of it needs the GPU: upstream Triton compiles
for ``GPUTarget("cuda", 90, 32)`` on any machine. A bundle is a directory of such kernels:

``bundle.json``
    ``{"format": 1, "triton": "triton-3.6.0", "target": "cuda:90"}``: the Triton release
    that compiled it and the target it was compiled for; a process with another Triton
    release, or a GPU of another architecture, does not use it (one warning line, then the
    kernels compile on first use as without a bundle).
``fqr_<key>.py``
    the generated source each kernel came from, named as in the kernel cache (``key``:
    program, tiling, layout, emitter and Triton versions: :func:`fqr.lowering.loader.cache_key`).
``<id>.cubin``, ``<id>.triton.json``, ``<id>.fqr.json``
    one compiled specialisation: the binary, Triton's own metadata (what
    ``triton.compiler.CompiledKernel`` reads), and fqr's record (the kernel key, the sha256
    of the source and of both files, Triton's specialisation). ``id`` hashes Triton's
    specialisation data (signature, constexprs, the divisibility attributes of the arguments,
    the compile options less the paths of the machine that compiled it).

**Building** (:class:`BundleWriter`, ``fqr build``): the kernels are launched as a call would
launch them, on ``meta`` tensors (shapes, dtypes and alignments, no values). Each launch runs
Triton's own warm-up path (``JITFunction.run(..., warmup=True)``) under a stand-in driver that
names the target GPU: Triton specialises the arguments and compiles exactly what the same
launch compiles on that GPU, and its ``jit_cache_hook`` hands over the specialisation data.

**Loading** (:func:`use_kernel_bundle`, ``FQR_KERNEL_BUNDLE=DIR``): Triton calls
``knobs.runtime.jit_cache_hook`` with its own cache key and specialisation right before it
would compile. For an fqr kernel whose specialisation the bundle holds, the hook puts the
bundle's ``CompiledKernel`` into the function's kernel cache under that key and declines the
compile; :func:`launch_through_triton` then launches again and Triton finds it. Anything the
bundle lacks compiles as usual and is counted (:data:`STATS`).

The kernel cache's rules hold (:mod:`.loader`): the directory must be owned by this user and
writable by nobody else, every file a regular file of this user's (never a link), the source
byte-equal to what this fqr generates and every file's sha256 the one fqr recorded; nothing in
a bundle is imported (the running kernel's source is the one fqr generated, as without a
bundle) and a cubin is loaded only after those checks.

A record (``bundle.json``, ``<id>.fqr.json``) is read only as the JSON object fqr writes: a
file that is not UTF-8, not JSON, nested past Python's recursion limit, larger than
:data:`RECORD_LIMIT`, or of another shape is a :class:`KernelBundleError` naming it. An entry's
``files`` must be exactly ``<id>.cubin`` and ``<id>.triton.json``, the two files handed to
Triton (a record naming ``../outside.bin`` or any other file is refused), and the binary Triton
read is compared with the one checked. With ``FQR_KERNEL_BUNDLE`` any such refusal is one
warning line and the bundle is dropped (kernels compile on first use); with
:func:`use_kernel_bundle` it is raised. A build (:class:`BundleWriter`) compiles a damaged
entry again and replaces it; it refuses a damaged ``bundle.json`` (naming it and what to do),
an output directory that is a symlink, and a target ``fqr`` cannot compile for
(:func:`compilable_archs`) before it creates anything.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import re
import stat
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .loader import directory_problem, replace_file_at, triton_version

log = logging.getLogger(__name__)

FORMAT = 1
BUNDLE_FILE = "bundle.json"
ENV = "FQR_KERNEL_BUNDLE"
# A record fqr writes (bundle.json, <id>.fqr.json) is a few hundred bytes; a larger file is
# not one, and is not read.
RECORD_LIMIT = 1 << 20
# The compute capabilities of the NVIDIA GPUs Triton's nvidia backend compiles for (70: Volta
# ... 121: GB10). A number outside it (71, 1000) is no GPU: LLVM aborts the process on it
# ("'sm_71' is not a recognized processor"), so it is refused before anything runs.
KNOWN_ARCHS = (70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101, 103, 110, 120, 121)


class KernelBundleError(OSError):
    """A kernel bundle cannot be used or written; the message names the path and the cause."""


class StaleBundleEntry(KernelBundleError):
    """An entry built from another source of the same kernel key (an fqr whose emitter changed
    since the build): its binary is never loaded. A launch that meets one compiles the kernel
    (one warning line) and keeps using the rest of the bundle."""


@dataclass(frozen=True)
class BundleTarget:
    """What a bundle is compiled for: ``cuda:<arch>`` (compute capability as one number, 90
    for Hopper; ``sm_90`` and ``sm90`` are read too)."""

    backend: str
    arch: int
    warp_size: int = 32

    @classmethod
    def parse(cls, text: str) -> BundleTarget:
        """``cuda:<arch>`` with ``arch`` among :data:`KNOWN_ARCHS` (ASCII digits); a ValueError
        naming the target otherwise. :meth:`check_compilable` asks the installed ptxas."""
        backend, _, arch = str(text).partition(":")
        arch = arch.lower().removeprefix("sm_").removeprefix("sm")
        if backend == "cuda" and arch.isascii() and arch.isdigit() and len(arch) <= 4:
            if int(arch) in KNOWN_ARCHS:
                return cls("cuda", int(arch))
            known = ", ".join(map(str, KNOWN_ARCHS))
            raise ValueError(
                f"target {text!r}: sm_{int(arch)} is no NVIDIA GPU architecture Triton compiles "
                f"for (cuda:<arch> with arch among {known})"
            )
        if backend == "ascend":
            raise ValueError(
                f"target {text!r}: Triton-Ascend compiles a kernel to its binary only with "
                "CANN's bishengir-compile on an Ascend host; ahead of time fqr reaches Ascend "
                "linalg (fqr lower --target ascend --check), not a loadable binary"
            )
        raise ValueError(f"target must be cuda:<arch> such as cuda:90, got {text!r}")

    def __str__(self) -> str:
        return f"{self.backend}:{self.arch}"

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)

    def check_compilable(self) -> None:
        """A ValueError naming the target unless the ptxas Triton runs for it lists it
        (:func:`compilable_archs`); nothing is checked where Triton's nvidia backend is not
        installed (a build then refuses for that reason)."""
        archs = compilable_archs()
        if archs is not None and self.arch not in archs:
            listed = ", ".join(map(str, sorted(archs)))
            raise ValueError(
                f"target '{self}': the ptxas of this Triton cannot compile for sm_{self.arch} "
                f"(it compiles for {listed})"
            )


@functools.lru_cache(maxsize=1)
def compilable_archs() -> frozenset[int] | None:
    """The :data:`KNOWN_ARCHS` that the ptxas Triton runs for each (``get_ptxas(arch)``: CUDA
    12's below sm_90 or sm_100, depending on the release, ``ptxas-blackwell`` above) lists
    among its ``--gpu-name`` values; None where that cannot be asked (Triton's nvidia backend
    not installed, no ptxas that runs): then only :data:`KNOWN_ARCHS` holds."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    listed: dict[str, set[int]] = {}
    archs = set()
    for arch in KNOWN_ARCHS:
        try:
            try:
                tool: Any = get_ptxas(arch)
            except TypeError:  # releases before the Blackwell ptxas: one for every arch
                tool = get_ptxas()  # type: ignore[call-arg,unused-ignore]
            path = str(tool[0] if isinstance(tool, tuple) else getattr(tool, "path", tool))
        except Exception:  # noqa: BLE001 (no ptxas: Triton raises its own kinds)
            continue
        if path not in listed:
            try:
                text = subprocess.run(
                    [path, "--help"], capture_output=True, text=True, timeout=30, check=False
                ).stdout
            except (OSError, subprocess.SubprocessError):
                text = ""
            listed[path] = {int(n) for n in re.findall(r"'sm_(\d+)a?'", text)}
        if arch in listed[path]:
            archs.add(arch)
    return frozenset(archs) if any(listed.values()) else None


@dataclass
class BundleStats:
    """What this process's bundle did: kernels ``loaded`` from it, kernels ``compiled`` here
    because it lacked them (their names in ``missing``), and the specialisation ids of both."""

    loaded: int = 0
    compiled: int = 0
    missing: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)

    def to_dict(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "compiled": self.compiled,
            "missing": list(self.missing),
            "ids": sorted(self.ids),
        }


STATS = BundleStats()

# id(JITFunction) -> (kernel cache key, generated source) of every fqr kernel lowered here.
_FQR_KERNELS: dict[int, tuple[Any, str, str]] = {}
_LOCK = threading.Lock()


def note_kernel(fn: Any, key: str, source: str) -> None:
    """Record that ``fn`` is the fqr kernel of cache key ``key`` generated as ``source``."""
    _FQR_KERNELS[id(fn)] = (fn, key, source)


def _kernel_of(fn: Any) -> tuple[str, str] | None:
    found = _FQR_KERNELS.get(id(fn))
    return None if found is None or found[0] is not fn else (found[1], found[2])


def specialisation_id(specialization_data: str) -> tuple[str, dict[str, Any]]:
    """The id of one compiled specialisation and its portable record, from the
    ``specialization_data`` Triton hands its ``jit_cache_hook``: everything but Triton's
    in-process cache key (which repeats the rest) and the ``extern_libs`` paths of the machine
    that compiles."""
    data = json.loads(specialization_data)
    data.pop("key", None)
    options = dict(data.get("options") or {})
    options.pop("extern_libs", None)
    data["options"] = options
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32], data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------- the directory


def _open_dir(directory: Path, *, create: bool) -> int:
    """An fd of ``directory`` after the kernel cache's checks: owned by this user, writable by
    nobody else (a missing one is created private when ``create``)."""
    try:
        if create:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KernelBundleError(f"kernel bundle {directory}: no such directory") from None
    except NotADirectoryError:
        raise KernelBundleError(f"kernel bundle {directory}: not a directory") from None
    except OSError as e:
        raise KernelBundleError(f"kernel bundle {directory}: {e.strerror}") from None
    problem = directory_problem(os.fstat(dfd))
    if problem:
        os.close(dfd)
        raise KernelBundleError(
            f"kernel bundle {directory} {problem}: whoever can write there can run code on "
            "your GPU; use a directory only you can write (chmod go-w)"
        )
    return dfd


def _plain_name(name: object) -> bool:
    """A file name inside the directory itself: no separator, not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and name == os.path.basename(name)
    )


def _read_own_file(dfd: int, directory: Path, name: str, limit: int | None = None) -> bytes | None:
    """The bytes of ``name`` (a plain name: never a path out of the directory) in the checked
    directory: None when missing; an error when it is a link, not a regular file, not this
    user's, writable by others, or larger than ``limit`` bytes."""
    if not _plain_name(name):
        raise KernelBundleError(
            f"kernel bundle {directory}: {name!r} is not a file name in the bundle"
        )
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "a symbolic link, not a file fqr wrote" if e.errno == errno.ELOOP else e.strerror
        raise KernelBundleError(f"kernel bundle file {directory / name}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise KernelBundleError(
                f"kernel bundle file {directory / name} is not a regular file of yours that "
                "only you can write"
            )
        if limit is not None and st.st_size > limit:
            raise KernelBundleError(
                f"kernel bundle file {directory / name} is {st.st_size} bytes, not a record "
                f"fqr wrote (at most {limit})"
            )
        chunks, left = [], limit + 1 if limit is not None else None
        while chunk := os.read(fd, 1 << 20 if left is None else min(left, 1 << 20)):
            chunks.append(chunk)
            if left is not None:
                left -= len(chunk)
                if left <= 0:
                    raise KernelBundleError(
                        f"kernel bundle file {directory / name} grew past {limit} bytes "
                        "while it was read"
                    )
        return b"".join(chunks)
    finally:
        os.close(fd)


def _record(raw: bytes, path: Path) -> dict[str, Any]:
    """The JSON object a record file holds (``raw``: its bytes); a :class:`KernelBundleError`
    naming ``path`` for anything else (not UTF-8, not JSON, nested past the recursion limit,
    not an object)."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise KernelBundleError(f"kernel bundle file {path} is damaged: not UTF-8 text") from None
    except RecursionError:
        raise KernelBundleError(
            f"kernel bundle file {path} is damaged: JSON nested too deeply to read"
        ) from None
    except ValueError as e:
        raise KernelBundleError(f"kernel bundle file {path} is damaged: {e}") from None
    if not isinstance(value, dict):
        raise KernelBundleError(
            f"kernel bundle file {path} is damaged: a JSON {type(value).__name__}, not the "
            "object fqr writes"
        )
    return value


def _head_problem(head: dict[str, Any]) -> str | None:
    """What is wrong with a ``bundle.json`` object, or None."""
    if type(head.get("format")) is not int:
        return f"no format number (got {head.get('format')!r})"
    if head["format"] != FORMAT:
        return f"format {head['format']}, this fqr reads {FORMAT}"
    for key in ("triton", "target"):
        if not isinstance(head.get(key), str):
            return f"no {key} name (got {head.get(key)!r})"
    return None


def _entry_problem(entry: dict[str, Any], ident: str) -> str | None:
    """What is wrong with the record ``<ident>.fqr.json`` (``entry``), or None: its files
    must be exactly the two handed to Triton, each with a sha256."""
    if not isinstance(entry.get("kernel_key"), str):
        return "no kernel_key"
    if not isinstance(entry.get("kernel"), str) or not entry["kernel"].isidentifier():
        return f"kernel {entry.get('kernel')!r} is not a kernel name"
    source = entry.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("sha256"), str):
        return "no source sha256"
    files = entry.get("files")
    if not isinstance(files, dict):
        return f"files is a {type(files).__name__}, not the object fqr writes"
    expected = _entry_files(ident)
    if set(files) != set(expected):
        names = ", ".join(map(repr, sorted(map(str, files))))
        return f"files names {names or 'nothing'}, not the files fqr builds ({', '.join(expected)})"
    if not all(isinstance(d, str) for d in files.values()):
        return "a file's sha256 is not a string"
    return None


def _entry_files(ident: str) -> tuple[str, str]:
    """The files of specialisation ``ident`` that Triton reads: the binary and its metadata."""
    return f"{ident}.cubin", f"{ident}.triton.json"


def _describe(target: Any) -> str:
    return f"{target.backend}:{target.arch}"


# ------------------------------------------------------------------------------ building


class _StandInDriver:
    """Triton's active driver while a bundle is built: device 0 of the target GPU, no stream;
    anything else (loading a binary, launching) is an error."""

    def __init__(self, target: Any):
        self._target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self._target

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"a kernel bundle build has no GPU: the driver cannot {name}")


@contextmanager
def stand_in_gpu(target: BundleTarget) -> Iterator[None]:
    """Within the block Triton's active driver is a :class:`_StandInDriver` of ``target``
    (what a build compiles under; the driver Triton had, None where it found none, after)."""
    from triton.runtime import driver

    previous = driver._active
    driver.set_active(_StandInDriver(target.gpu_target()))
    try:
        yield
    finally:
        driver._active = previous


_WRITER: BundleWriter | None = None


class BundleWriter:
    """Compiles every launch it is given for ``target`` into the bundle ``directory``
    (created private; an existing bundle of the same Triton release and target is added to).

    Use as a context manager, or :meth:`open` / :meth:`close`: while open, a launch on
    ``meta`` tensors (:meth:`fqr.lowering.kernel.Kernel.launch`) comes here instead of running.
    A specialisation the bundle already holds intact is not compiled again (a build adds what
    is new); several processes may add to one bundle at once (each file is replaced
    atomically)."""

    def __init__(self, directory: str | os.PathLike, target: str | BundleTarget = "cuda:90"):
        self.directory = Path(directory)
        self.target = target if isinstance(target, BundleTarget) else BundleTarget.parse(target)
        self.written = 0  # specialisations compiled into the bundle by this writer
        self.seen: set[str] = set()  # specialisation ids launched while open
        self._dfd: int | None = None
        self._driver: Any = None

    def check(self) -> None:
        """What :meth:`open` refuses, with nothing created or written: a target the installed
        ptxas cannot compile for, an output directory that is a symlink or not a directory,
        one that is unsafe (:func:`_open_dir`), or a ``bundle.json`` there that is damaged or
        of another Triton release or target (the message names it and what to do)."""
        self.target.check_compilable()
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return
        except OSError as e:
            raise KernelBundleError(f"kernel bundle {self.directory}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise KernelBundleError(
                f"kernel bundle {self.directory} is a symlink (refused: fqr never writes "
                "through a symlink; name the directory itself)"
            )
        dfd = _open_dir(self.directory, create=False)
        try:
            self._check_head(dfd)
        finally:
            os.close(dfd)

    def _head(self) -> dict[str, Any]:
        return {"format": FORMAT, "triton": triton_version(), "target": str(self.target)}

    def _check_head(self, dfd: int) -> bool:
        """Whether the directory open as ``dfd`` has this build's ``bundle.json`` (False: none);
        a :class:`KernelBundleError` naming it when it is damaged or another build's."""
        path = self.directory / BUNDLE_FILE
        found = _read_own_file(dfd, self.directory, BUNDLE_FILE, RECORD_LIMIT)
        if found is None:
            return False
        try:
            head = _record(found, path)
        except KernelBundleError as e:
            raise KernelBundleError(
                f"{e}; remove the directory {self.directory} and build again, or build into an "
                "empty directory"
            ) from None
        if head != self._head():
            raise KernelBundleError(
                f"kernel bundle {self.directory} holds {head}, not {self._head()}: build into "
                "an empty directory"
            )
        return True

    def open(self) -> BundleWriter:
        global _WRITER
        if _WRITER is not None:
            raise RuntimeError("a kernel bundle is already being built in this process")
        try:
            from triton.backends.compiler import GPUTarget  # noqa: F401
        except ImportError:  # pragma: no cover
            raise RuntimeError("building a kernel bundle needs upstream Triton") from None
        self.check()
        self._dfd = _open_dir(self.directory, create=True)
        try:
            found = self._check_head(self._dfd)
        except KernelBundleError:
            os.close(self._dfd)
            self._dfd = None
            raise
        if not found:
            self._replace(BUNDLE_FILE, _json_bytes(self._head()))
        self._driver = stand_in_gpu(self.target)
        self._driver.__enter__()
        _WRITER = self
        return self

    def close(self) -> None:
        global _WRITER
        if _WRITER is self:
            _WRITER = None
            self._driver.__exit__(None, None, None)
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None

    def __enter__(self) -> BundleWriter:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _replace(self, name: str, data: bytes) -> None:
        """Replace ``name`` in the bundle by ``data`` (atomically, never through a link); an
        OS error is a :class:`KernelBundleError` naming the file."""
        assert self._dfd is not None, "the writer is not open"
        try:
            replace_file_at(self._dfd, name, data, mode=0o600)
        except OSError as e:
            raise KernelBundleError(
                f"cannot write the kernel bundle file {self.directory / name}: {e.strerror}"
            ) from None

    def _holds(self, ident: str, key: str, source: str) -> bool:
        """Whether the bundle already holds specialisation ``ident`` of kernel ``key``, intact
        (a damaged entry is reported in one warning line, then compiled again and replaced)."""
        try:
            return KernelBundle.open(self.directory).metadata_group(ident, key, source) is not None
        except KernelBundleError as e:
            log.warning("%s: compiling it again", e)
            return False

    def compile(self, fn: Any, grid: tuple, args: list, kwargs: dict[str, Any]) -> None:
        """Compile ``fn``'s launch with ``args`` (``meta`` tensors and ints) and ``kwargs``
        (constexprs and launch options) as the target GPU would, into the bundle."""
        from triton import knobs

        known = _kernel_of(fn)
        if known is None:
            raise RuntimeError(f"{fn} is not a kernel fqr lowered: nothing to bundle")
        key, source = known
        captured: list[str] = []

        def capture(**hook_args: Any) -> bool | None:
            data = hook_args["compile"]["specialization_data"]
            ident, _ = specialisation_id(data)
            if self._holds(ident, key, source):  # an earlier build compiled it: no compile
                self.seen.add(ident)
                return True
            captured.append(data)
            return None

        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = capture
        try:
            compiled = fn.run(*args, grid=grid, warmup=True, **kwargs)
        finally:
            knobs.runtime.jit_cache_hook = previous
        if not captured:  # in the bundle already, or compiled by this process before
            return
        ident, record = specialisation_id(captured[0])
        self.seen.add(ident)
        assert self._dfd is not None, "the writer is not open"
        metadata = Path(next(p for n, p in compiled.metadata_group.items() if n.endswith(".json")))
        files = {
            f"{ident}.cubin": bytes(compiled.asm["cubin"]),
            f"{ident}.triton.json": metadata.read_bytes(),
        }
        source_name = f"fqr_{key}.py"
        try:
            same = _read_own_file(self._dfd, self.directory, source_name) == source.encode()
        except KernelBundleError:
            same = False  # a link or another's file there: replaced, never written through
        if not same:
            self._replace(source_name, source.encode())
        for name, data in files.items():
            self._replace(name, data)
        entry = {
            "kernel_key": key,
            "kernel": compiled.name,
            "source": {"file": source_name, "sha256": _sha256(source.encode())},
            "files": {name: _sha256(data) for name, data in files.items()},
            "specialisation": record,
        }
        self._replace(f"{ident}.fqr.json", _json_bytes(entry))
        self.written += 1
        log.info("bundled %s (%s) for %s", compiled.name, ident, self.target)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def active_writer() -> BundleWriter | None:
    """The bundle being built in this process, if any."""
    return _WRITER


def building_for(device_type: str) -> bool:
    """Whether a bundle build is open in this process for kernels that run on ``device_type``
    (``cuda`` for a ``cuda:<arch>`` bundle: every lowering target compiled for CUDA)."""
    return _WRITER is not None and _WRITER.target.backend == device_type


def compile_ahead(fn: Any, grid: tuple, args: list, kwargs: dict[str, Any]) -> None:
    """A launch on ``meta`` tensors: compiled into the open bundle, else refused."""
    if _WRITER is None:
        raise ValueError(
            "meta tensors hold no values: a kernel launches on them only while a kernel "
            "bundle is built (fqr build, fqr.lowering.bundle.BundleWriter)"
        )
    _WRITER.compile(fn, grid, args, kwargs)


# ------------------------------------------------------------------------------- loading


@dataclass
class KernelBundle:
    """A checked bundle directory (:meth:`open`) and what it was built with."""

    directory: Path
    triton: str
    target: str

    @classmethod
    def open(cls, directory: str | os.PathLike) -> KernelBundle:
        """Check ``directory`` and read its ``bundle.json``; :class:`KernelBundleError` names
        what is wrong."""
        directory = Path(directory)
        dfd = _open_dir(directory, create=False)
        try:
            raw = _read_own_file(dfd, directory, BUNDLE_FILE, RECORD_LIMIT)
        finally:
            os.close(dfd)
        if raw is None:
            raise KernelBundleError(f"kernel bundle {directory}: no {BUNDLE_FILE} (run fqr build)")
        head = _record(raw, directory / BUNDLE_FILE)
        problem = _head_problem(head)
        if problem:
            raise KernelBundleError(
                f"kernel bundle file {directory / BUNDLE_FILE} is damaged: {problem}"
            )
        return cls(directory, head["triton"], head["target"])

    def refusal(self) -> str | None:
        """Why this process cannot use the bundle (another Triton release), or None."""
        here = triton_version()
        if self.triton != here:
            return (
                f"kernel bundle {self.directory} was built by {self.triton} for {self.target}; "
                f"this process runs {here}: not used, kernels compile on first use"
            )
        return None

    def metadata_group(self, ident: str, key: str, source: str) -> dict[str, str] | None:
        """The files Triton's ``CompiledKernel`` reads for specialisation ``ident`` of the
        kernel ``key`` generated as ``source``, after every check; None where the bundle
        does not hold it."""
        checked = self.checked_entry(ident, key, source)
        return None if checked is None else checked[0]

    def checked_entry(
        self, ident: str, key: str, source: str
    ) -> tuple[dict[str, str], dict[str, str]] | None:
        """:meth:`metadata_group` and the sha256 of each file handed to Triton, by its name
        in the bundle. The record must be the JSON object fqr writes, its ``files`` exactly
        the two handed to Triton (:func:`_entry_files`), each read (never through a link)
        and equal to its recorded sha256; a :class:`KernelBundleError` names what is wrong."""
        if not _plain_name(f"{ident}.fqr.json") or not ident.isalnum():
            raise KernelBundleError(f"kernel bundle {self.directory}: bad specialisation id")
        record = self.directory / f"{ident}.fqr.json"
        dfd = _open_dir(self.directory, create=False)
        try:
            raw = _read_own_file(dfd, self.directory, record.name, RECORD_LIMIT)
            if raw is None:
                return None
            entry = _record(raw, record)
            problem = _entry_problem(entry, ident)
            if problem:
                raise KernelBundleError(f"kernel bundle entry {record} is damaged: {problem}")
            if entry["kernel_key"] != key:
                return None
            if entry["source"]["sha256"] != _sha256(source.encode()):
                raise StaleBundleEntry(
                    f"kernel bundle entry {record}: its source is not the one this fqr "
                    "generates for that kernel"
                )
            for name in _entry_files(ident):
                data = _read_own_file(dfd, self.directory, name)
                if data is None or _sha256(data) != entry["files"][name]:
                    raise KernelBundleError(
                        f"kernel bundle file {self.directory / name} is missing or altered "
                        "(its sha256 is not the one recorded when it was built)"
                    )
        finally:
            os.close(dfd)
        # Triton reads the metadata (a name ending in .json) and the binary by its suffix:
        # exactly the two files checked above.
        binary, metadata = _entry_files(ident)
        name = entry["kernel"]
        group = {
            f"{name}.json": str(self.directory / metadata),
            f"{name}.cubin": str(self.directory / binary),
        }
        return group, {n: entry["files"][n] for n in (binary, metadata)}


_ACTIVE: KernelBundle | None = None
_FROM_ENV = False  # _ACTIVE came from $FQR_KERNEL_BUNDLE: a refusal warns and drops it
_ENV_READ = False
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def use_kernel_bundle(directory: str | os.PathLike | None) -> KernelBundle | None:
    """Load fqr's CUDA kernels from the bundle ``directory`` (``fqr build``) from now on in
    this process, instead of compiling them; None stops. Returns the bundle, or None when it
    cannot be used here (another Triton release: one warning line, kernels compile on first
    use). A directory that is unsafe or not a bundle raises :class:`KernelBundleError`."""
    global _ACTIVE, _ENV_READ, _FROM_ENV
    _ENV_READ = True
    _FROM_ENV = False
    if directory is None:
        _ACTIVE = None
        return None
    bundle = KernelBundle.open(directory)
    reason = bundle.refusal()
    if reason:
        _warn_once(reason)
        _ACTIVE = None
        return None
    _ACTIVE = bundle
    _install_hook()
    log.info("kernel bundle %s (%s, %s) in use", bundle.directory, bundle.triton, bundle.target)
    return bundle


def active_bundle() -> KernelBundle | None:
    """The bundle in use: :func:`use_kernel_bundle`'s, else ``$FQR_KERNEL_BUNDLE``'s (read at
    the first kernel launch of the process; an unusable one is reported once and skipped)."""
    global _ENV_READ, _FROM_ENV
    if not _ENV_READ:
        with _LOCK:
            if not _ENV_READ:
                _ENV_READ = True
                path = os.environ.get(ENV)
                if path:
                    try:
                        _FROM_ENV = use_kernel_bundle(path) is not None
                    except KernelBundleError as e:
                        _warn_once(f"{ENV}: {e}; kernels compile on first use")
    return _ACTIVE


_HOOKED = False
# Set by the hook when it put a bundle's kernel in Triton's cache (this thread's launch).
_TAKEN = threading.local()


def _install_hook() -> None:
    global _HOOKED
    if _HOOKED:
        return
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook

    def load_from_bundle(**hook_args: Any) -> bool | None:
        taken = _take_from_bundle(hook_args)
        if taken is None and previous is not None:
            return previous(**hook_args)
        return taken

    knobs.runtime.jit_cache_hook = load_from_bundle
    _HOOKED = True


def _take_from_bundle(hook_args: dict[str, Any]) -> bool | None:
    """Triton's ``jit_cache_hook``: True (no compile) once the bundle's kernel for this
    specialisation is in the function's kernel cache; None to let Triton compile."""
    bundle = _ACTIVE
    info = hook_args.get("fn")
    jit: Any = getattr(info, "jit_function", None)
    known = _kernel_of(jit) if jit is not None else None
    if bundle is None or known is None or _WRITER is not None:
        return None
    key, source = known
    compile_args = hook_args["compile"]
    ident, _ = specialisation_id(compile_args["specialization_data"])
    device = compile_args["device"]
    kernel_cache, _, target, _, _ = jit.device_caches[device]
    STATS.ids.add(ident)
    if _describe(target) != bundle.target:
        _warn_once(
            f"kernel bundle {bundle.directory} was built for {bundle.target}; this GPU is "
            f"{_describe(target)}: not used, kernels compile on first use"
        )
        group = None
    else:
        group = _checked_group(bundle, ident, key, source)
    if group is None:
        STATS.compiled += 1
        STATS.missing.append(f"{jit.__name__}:{ident}")
        log.info("kernel bundle has no %s (%s): compiling it", jit.__name__, ident)
        return None
    from triton.compiler import ASTSource, CompiledKernel

    src = ASTSource(
        jit, compile_args["signature"], compile_args["constants"], compile_args["configs"][0]
    )
    kernel = CompiledKernel(src, group[0], ident)
    binary = _entry_files(ident)[0]
    if (
        _sha256(bytes(kernel.asm["cubin"])) != group[1][binary]
    ):  # what Triton read is what was checked
        _refuse(
            KernelBundleError(
                f"kernel bundle file {bundle.directory / binary} changed while it was loaded"
            )
        )
        STATS.compiled += 1
        return None
    kernel_cache[hook_args["key"]] = kernel
    STATS.loaded += 1
    _TAKEN.flag = True
    return True


def _refuse(error: KernelBundleError) -> None:
    """A bundle's file failed a check at a launch: with ``FQR_KERNEL_BUNDLE`` one warning line
    and the bundle is dropped (kernels compile on first use); else the error is raised."""
    global _ACTIVE
    if not _FROM_ENV:
        raise error
    _warn_once(f"{ENV}: {error}; the bundle is not used, kernels compile on first use")
    _ACTIVE = None


def _checked_group(
    bundle: KernelBundle, ident: str, key: str, source: str
) -> tuple[dict[str, str], dict[str, str]] | None:
    """:meth:`KernelBundle.checked_entry`, a refusal handled by :func:`_refuse` (None)."""
    try:
        return bundle.checked_entry(ident, key, source)
    except StaleBundleEntry as e:
        _warn_once(f"{e} (an older build): compiling it; the rest of the bundle is used")
        return None
    except KernelBundleError as e:
        _refuse(e)
        return None


def launch_through_triton(fn: Any, grid: tuple, args: list, kwargs: dict[str, Any]) -> Any:
    """``fn[grid](*args, **kwargs)``, Triton's own launch; where the bundle's kernel went into
    Triton's cache instead of a compile (Triton then returns without launching), it launches
    again and Triton finds it. Returns Triton's ``CompiledKernel`` (None: a hook declined)."""
    if active_bundle() is None:
        return fn[grid](*args, **kwargs)
    _TAKEN.flag = False
    kernel = fn[grid](*args, **kwargs)
    if _TAKEN.flag:
        _TAKEN.flag = False
        kernel = fn[grid](*args, **kwargs)
    return kernel


@contextmanager
def building(directory: str | os.PathLike, target: str | BundleTarget = "cuda:90") -> Iterator:
    """``with building(dir, "cuda:90") as writer:`` every fqr launch on ``meta`` tensors in
    the block is compiled into the bundle ``dir``."""
    writer = BundleWriter(directory, target).open()
    try:
        yield writer
    finally:
        writer.close()
