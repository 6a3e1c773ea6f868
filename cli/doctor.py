"""``fqr doctor``: what this machine has, and why each backend is or is not available."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
from typing import Annotated

import torch
import typer
from rich.table import Table
from rich.text import Text

from .common import app, out


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _facts() -> dict:
    import os

    from fqr._version import __version__
    from fqr.lowering.loader import cache_dir

    facts = {
        "fqr": __version__,
        "kernel_cache": str(cache_dir()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "triton-ascend": _version("triton-ascend"),
        "torch_npu": _version("torch_npu") or _version("torch-npu"),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "cann": os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH"),
    }
    from fqr.lowering.ascend_compile import ascend_facts

    facts.update(ascend_facts())
    return facts


@app.command()
def doctor(json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False):
    """Report torch / triton / triton-ascend / torch_npu / CANN presence and backend status."""
    from fqr.backends import BACKENDS

    facts = _facts()
    backends = {name: (b.unavailable_reason() or "available") for name, b in BACKENDS.items()}
    if json_out:
        out.print_json(json.dumps({"environment": facts, "backends": backends}))
        return
    env = Table(title="environment", show_header=False)
    for k, v in facts.items():
        env.add_row(k, Text(str(v if v not in (None, [], "") else "-")))
    out.print(env)
    tb = Table(title="backends")
    tb.add_column("backend")
    tb.add_column("status")
    for name, status in backends.items():
        tb.add_row(
            name,
            Text(status, style="green" if status == "available" else "yellow"),
        )
    out.print(tb)
