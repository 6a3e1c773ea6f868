"""Write generated sources to the kernel cache directory and import them.

Triton needs kernels in real files (it reads their source), so each generated kernel is a
module ``<cache>/fqr_<key>.py``; ``key`` hashes the program, the target, its tiling, the
emitter version and the installed triton version, so a second process finds and reuses it.
The directory is ``$FQR_CACHE_DIR`` or ``~/.cache/fqr/kernels``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    d = Path(os.environ.get("FQR_CACHE_DIR") or Path.home() / ".cache" / "fqr" / "kernels")
    d.mkdir(parents=True, exist_ok=True)
    return d


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


def cached_source(key: str) -> tuple[Path, str | None]:
    path = cache_dir() / f"fqr_{key}.py"
    return path, (path.read_text() if path.exists() else None)


def write_source(path: Path, source: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)  # atomic: concurrent writers of the same key agree on the bytes


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


def import_kernel(path: Path, kernel_name: str, interpret: bool) -> Any:
    """Import ``path`` and return its kernel; ``interpret`` decorates it for the interpreter."""
    mod_name = f"fqr_kernels.{path.stem}{'_interpret' if interpret else ''}"
    if mod_name in sys.modules:
        return getattr(sys.modules[mod_name], kernel_name)
    require_triton_mode(interpret)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the generated kernel {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[mod_name] = module
    return getattr(module, kernel_name)
