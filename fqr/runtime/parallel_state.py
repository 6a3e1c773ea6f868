"""Process groups laid out as vLLM lays them out (``vllm/distributed/parallel_state.py``).

World ranks are arranged as ``arange(world).reshape(DP, TP)`` (pipeline parallel size 1):
a TP group is a row (consecutive ranks, ``rank = dp_rank * tp + tp_rank``), a DP group is a
column (same TP rank in every DP replica). Every group gets a **device group** (NCCL on CUDA,
HCCL on Ascend, gloo on CPU) for the tensor collectives and a **gloo CPU group** beside it for
metadata, as vLLM's ``GroupCoordinator`` does. ``new_group`` is collective over the world, so
every rank creates every group, in the same order, and keeps its own.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Layout:
    """Where world rank ``rank`` sits in a ``dp x tp`` world."""

    dp: int
    tp: int

    def __post_init__(self):
        for name, v in (("dp", self.dp), ("tp", self.tp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of world rank ``rank``."""
        return divmod(rank, self.tp)

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, t) for t in range(self.tp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, t) for d in range(self.dp)] for t in range(self.tp)]

    def describe(self, rank: int) -> str:
        d, t = self.coords(rank)
        return f"rank {rank} (dp {d}, tp {t})"

    @classmethod
    def from_world(cls, world_size: int, tp: int, dp: int | None = None) -> Layout:
        """The layout of a launcher-given world (torchrun): ``dp`` defaults to world / tp."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"--tp {tp} does not divide the world size {world_size}")
        if dp is None:
            dp = world_size // tp
        if dp * tp != world_size:
            raise ValueError(f"--dp {dp} x --tp {tp} = {dp * tp} != world size {world_size}")
        return cls(dp, tp)


@dataclass
class GroupPair:
    """One parallel group: its ranks, the device group and the gloo CPU group beside it."""

    ranks: list[int]
    device_group: object
    cpu_group: object

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelGroups:
    layout: Layout
    rank: int
    world: GroupPair
    tp: GroupPair
    dp: GroupPair


def init_distributed(
    layout: Layout,
    rank: int,
    device: torch.device,
    *,
    timeout_s: float,
    store=None,
    init_method: str | None = None,
) -> ParallelGroups:
    """``init_process_group`` for the world, then the TP and DP groups (device + gloo CPU).

    Exactly one of ``store`` (a ``TCPStore`` hosted by the engine) or ``init_method``
    (``env://`` under torchrun) says where to rendezvous. Every collective times out after
    ``timeout_s``, so a dead or hung peer ends the run instead of hanging it.
    """
    backend = DEVICE_BACKENDS[device.type]
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = dict(backend=backend, rank=rank, world_size=layout.world_size, timeout=timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method or "env://"
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    world_cpu = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=timeout)
    world = GroupPair(list(range(layout.world_size)), dist.group.WORLD, world_cpu)
    mine = {}
    for kind, groups in (("tp", layout.tp_groups()), ("dp", layout.dp_groups())):
        for ranks in groups:
            device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                mine[kind] = GroupPair(ranks, device_group, cpu_group)
    return ParallelGroups(layout, rank, world, mine["tp"], mine["dp"])


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
