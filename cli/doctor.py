"""``fqr doctor``: what this machine has, and why each backend is or is not available.

Prints fqr's version, the kernel cache directory, torch / triton / triton-ascend / torch_npu /
CANN, the peers fqr works beside (transformers, vLLM, Liger-Kernel: importable or not, with
their versions) and each backend's status. Exit 0; ``ok`` in the JSON document says whether
any backend that lowers fqr's kernels (any but the reference) is available here.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import platform

import torch
from rich.table import Table
from rich.text import Text

from .common import app, example, out, schema
from .options import JsonOption

# The libraries fqr plugs into or is measured against: (import name, distribution name).
PEERS = {
    "transformers": ("transformers", "transformers"),
    "vllm": ("vllm", "vllm"),
    "liger-kernel": ("liger_kernel", "liger-kernel"),
}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def peers() -> dict[str, str | None]:
    """Each peer's installed version, None when it cannot be imported here (found by its
    import spec: nothing is imported)."""
    return {
        name: (_version(dist) or "installed") if importlib.util.find_spec(module) else None
        for name, (module, dist) in PEERS.items()
    }


def _facts() -> dict:
    import os

    from fqr._version import __version__
    from fqr.lowering.ascend_compile import ascend_facts
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
    facts.update(ascend_facts())
    return facts


@app.command(epilog=example("fqr doctor --json"))
def doctor(json_out: JsonOption = False):
    """Report fqr, the kernel cache, torch / triton / Ascend, peers and backend status."""
    from fqr.backends import BACKENDS

    facts = _facts()
    found = peers()
    backends = {name: (b.unavailable_reason() or "available") for name, b in BACKENDS.items()}
    compiled = [n for n, s in backends.items() if s == "available" and BACKENDS[n].target]
    if json_out:
        doc = {
            "schema": schema("doctor"),
            "ok": bool(compiled),
            "environment": facts,
            "peers": found,
            "backends": backends,
        }
        out.print_json(json.dumps(doc))
        return
    env = Table(title="environment", show_header=False)
    for k, v in facts.items():
        env.add_row(k, Text(str(v if v not in (None, [], "") else "-")))
    out.print(env)
    peer_table = Table(title="peers")
    peer_table.add_column("library")
    peer_table.add_column("version")
    for name, version in found.items():
        peer_table.add_row(name, Text(version or "not importable", style="" if version else "dim"))
    out.print(peer_table)
    tb = Table(title="backends")
    tb.add_column("backend")
    tb.add_column("status")
    for name, status in backends.items():
        tb.add_row(name, Text(status, style="green" if status == "available" else "yellow"))
    out.print(tb)
