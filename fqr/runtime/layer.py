"""One worker's attention-prologue layer state: its TP shard of the heads, and its forward.

A TP rank holds q heads ``[r*hq, (r+1)*hq)`` and kv heads ``[o, o+hkv)`` with
``o = preset.kv_head_owner(r)`` (kv heads are replicated when ``num_kv_heads < tp``). Its qkv
row is ``[q shard | k shard | v shard]`` of the unsharded projection (:meth:`shard_columns`).

Full-width norm (OLMo2, ``preset.norm == "full"``) under TP: the statistic spans heads on
other ranks. Each rank computes the float32 per-token sum of squares of its q and k shard
(:meth:`partial_sum_sq`; a replicated kv head counts only on the first rank holding it), the
TP group all-reduces ``[2, T]``, and the fused op finishes with the global statistic
(``norm_stats=fqr.NormStats(q_sum_sq, k_sum_sq, Hq*D, Hkv*D)``), as vllm-ascend's
MiniMax-M2 QK-norm does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from ..presets import get_preset
from ..prologue import NormStats, split_qkv_rmsnorm_rope
from .workload import model_norm_weights


@lru_cache(maxsize=4)
def _rope_table(preset_name: str) -> torch.Tensor:
    """The preset's float32 ``cos_sin_cache`` (built once per process and preset)."""
    return get_preset(preset_name).cos_sin_cache()


def shard_heads(shard, tp_rank: int) -> tuple[range, range]:
    """(q heads, kv heads) of the unsharded model that TP rank ``tp_rank`` holds."""
    first_kv = shard.kv_head_owner(tp_rank)
    return (
        range(tp_rank * shard.num_heads, (tp_rank + 1) * shard.num_heads),
        range(first_kv, first_kv + shard.num_kv_heads),
    )


class PrologueLayer:
    def __init__(
        self,
        preset_name: str,
        tp: int,
        tp_rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        numerics: str = "fused",
        backend: str = "reference",
    ):
        if not 0 <= tp_rank < tp:
            raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
        self.full = get_preset(preset_name)
        self.shard = get_preset(preset_name, tp)
        self.tp, self.tp_rank = tp, tp_rank
        self.dtype, self.device, self.numerics, self.backend = dtype, device, numerics, backend
        s, d = self.shard, self.shard.head_dim
        self.q_heads, self.kv_heads = shard_heads(s, tp_rank)
        first_kv = self.kv_heads.start
        # A replicated kv head counts once in the k statistic: on the first rank that holds it.
        self.counts_k = tp_rank == 0 or s.kv_head_owner(tp_rank - 1) != first_kv
        self.columns = self.shard_columns()
        self.cos_sin_cache = _rope_table(preset_name).to(device)
        q_w, k_w = model_norm_weights(self.full, seed, dtype)
        if self.full.norm == "full":
            q_w = q_w[self.q_heads.start * d : self.q_heads.stop * d]
            k_w = k_w[self.kv_heads.start * d : self.kv_heads.stop * d]
        self.q_weight = None if q_w is None else q_w.contiguous().to(device)
        self.k_weight = None if k_w is None else k_w.contiguous().to(device)

    @property
    def needs_allreduce(self) -> bool:
        return self.full.norm == "full" and self.tp > 1

    def shard_columns(self) -> torch.Tensor:
        """Columns of the unsharded qkv row that this rank holds, in ``[q | k | v]`` order."""
        d, f = self.shard.head_dim, self.full.spec
        q = torch.arange(self.q_heads.start * d, self.q_heads.stop * d)
        k = f.q_size + torch.arange(self.kv_heads.start * d, self.kv_heads.stop * d)
        return torch.cat([q, k, k + f.kv_size])

    def local_rows(self, qkv_full: torch.Tensor) -> torch.Tensor:
        """This rank's ``[T, (hq + 2*hkv) * D]`` slice of the unsharded rows, on its device."""
        return qkv_full.index_select(1, self.columns).to(self.device)

    def partial_sum_sq(self, qkv: torch.Tensor) -> torch.Tensor:
        """float32 ``[2, T]``: this rank's share of the per-token sums of squares of q and k."""
        s = self.shard.spec
        x = qkv.to(torch.float32)
        q_ss = x[:, : s.q_size].square().sum(dim=1)
        k_ss = x[:, s.q_size : s.q_size + s.kv_size].square().sum(dim=1)
        if not self.counts_k:
            k_ss = torch.zeros_like(k_ss)
        return torch.stack([q_ss, k_ss])

    def forward(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
    ):
        """``(q, k, v)`` of this shard. ``all_reduce`` sums a tensor in place over the TP group
        (needed only for full-width norm with tp > 1)."""
        stats = None
        if self.needs_allreduce and qkv.shape[0] > 0:  # a DP replica's TP ranks agree on T
            if all_reduce is None:
                raise ValueError("all_reduce is required for a full-width norm with tp > 1")
            sums = self.partial_sum_sq(qkv)
            all_reduce(sums)
            stats = NormStats(
                sums[0].contiguous(),
                sums[1].contiguous(),
                self.full.spec.q_size,
                self.full.spec.kv_size,
            )
        return split_qkv_rmsnorm_rope(
            qkv,
            positions.to(self.device),
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            **self.shard.spec.kwargs(
                norm_stats=stats, numerics=self.numerics, backend=self.backend
            ),
        )
