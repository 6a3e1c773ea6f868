"""Device binding and memory snapshots of a worker (vLLM ``Worker.init_device``).

A worker's local device index is its TP rank offset by its DP replica, as in vLLM:
``local_rank = tp_rank + dp_local_rank * tp_size`` (pipeline parallel size 1). On CPU there is
nothing to bind; each worker is limited to one intra-op thread so ``dp x tp`` workers do not
oversubscribe the cores. The memory snapshot is the device's used memory on GPU/NPU and the
process's resident set on CPU; :func:`host_memory_available` is what the host (and its memory
cgroup) can still give, checked before a run starts.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEVICE_TYPES = ("cpu", "cuda", "npu")


def local_device_index(tp_rank: int, dp_local_rank: int, tp_size: int) -> int:
    return tp_rank + dp_local_rank * tp_size


def _accelerator(device_type: str):
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    return getattr(torch, device_type)


def bind_device(device_type: str, local_rank: int, what: str) -> torch.device:
    """Bind this process to ``device_type:local_rank``; ``what`` names the rank in errors."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_TYPES)}, got {device_type!r}")
    if device_type == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    acc = _accelerator(device_type)
    if not acc.is_available():
        raise RuntimeError(f"{what}: no {device_type} device is visible")
    count = acc.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"{what}: needs {device_type}:{local_rank} but only {count} "
            f"{device_type} device(s) are visible (dp x tp exceeds the devices)"
        )
    acc.set_device(local_rank)
    return torch.device(device_type, local_rank)


@dataclass
class MemorySnapshot:
    """``used_bytes``: device memory in use (GPU/NPU: total - free) or RSS (CPU);
    ``torch_peak_bytes``: the caching allocator's peak (0 on CPU)."""

    device: str
    used_bytes: int
    total_bytes: int
    torch_peak_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2 ``memory.max``/``memory.current``,
    v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            candidates = [
                (root / rel, "memory.max", "memory.current"),
                (root, "memory.max", "memory.current"),
            ]
        elif "memory" in controllers.split(","):
            mem = root / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            candidates = [(mem / rel, *names), (mem, *names)]
        else:
            continue
        for directory, limit_name, usage_name in candidates:  # the process's own, else the root
            limit, usage = _read_int(directory / limit_name), _read_int(directory / usage_name)
            if (directory / limit_name).exists():
                if limit is None or usage is None or limit >= 1 << 60:  # v1's "unlimited"
                    break
                return max(0, limit - usage)
    return None


def host_memory_available() -> int | None:
    """Bytes the host can still give this process's workload before the OOM killer acts:
    ``MemAvailable`` of ``/proc/meminfo``, capped by the memory cgroup's room (a container's
    limit is often far below the machine's memory). None where neither is known."""
    known = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    room = _cgroup_room()
    if room is not None:
        known.append(room)
    return min(known) if known else None


def memory_snapshot(device: torch.device) -> MemorySnapshot:
    if device.type == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return MemorySnapshot("cpu", _rss_bytes(), total, 0)
    acc = _accelerator(device.type)
    acc.synchronize(device)
    free, total = acc.mem_get_info(device)
    return MemorySnapshot(str(device), total - free, total, acc.max_memory_allocated(device))
