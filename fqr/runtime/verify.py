"""Verification of a run's outputs against the unsharded float64 expectation.

For a verified step, every DP replica's batch is redrawn from its seed (``workload.step_qkv``)
and evaluated by :func:`fqr.reference.prologue` (the prologue's formulas in float64, an
implementation independent of the ops' reference rules) on the **unsharded** model. Each TP
rank's outputs are its heads of that expectation, so comparing every shard with its slice
under the numerics contract (:func:`fqr.numerics.compare`) is comparing the TP-gathered output,
and a mismatch names the rank. ``v`` must match bit for bit. For full-width norm the
expectation normalises over the whole q/k width, so it checks the TP all-reduce as well.

The probe batch runs the same input on every DP replica: replicas holding the same TP shard
must return bit-identical outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .. import reference
from ..numerics import compare
from ..presets import get_preset
from .layer import shard_heads
from .parallel_state import Layout
from .scheduler import StepPlan
from .workload import PROBE_STREAM, model_norm_weights, probe_positions, segment_positions, step_qkv

VERIFY_CHUNK_ELEMENTS = 1 << 18  # qkv elements whose expectation is computed at once


@dataclass
class RankVerification:
    checks: int = 0
    passed: int = 0
    # The raw ULP count of the worst element, compared with the correctly rounded float64
    # value: it includes elements below the fp32 compute floor of their head (RoPE cancelling
    # to near zero), which the contract passes on an absolute bound, so a fused run can show
    # several ULPs and pass. ``max_err_ratio`` is the contract's own measure: the worst
    # element's error as a fraction of what its tolerance allows (<= 1 passes; as fqr verify's
    # err/tol, fqr.numerics.Comparison.error_ratio).
    max_ulp: int = 0
    max_rel: float = 0.0
    max_err_ratio: float = 0.0
    probe_identical: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Verifier:
    def __init__(
        self, preset_name: str, layout: Layout, *, dtype: torch.dtype, numerics: str, seed: int
    ):
        self.full = get_preset(preset_name)
        self.shard = get_preset(preset_name, layout.tp)
        self.layout, self.dtype, self.numerics, self.seed = layout, dtype, numerics, seed
        self.cos_sin_cache = self.full.cos_sin_cache()
        self.q_weight, self.k_weight = model_norm_weights(self.full, seed, dtype)
        self.ranks = {r: RankVerification() for r in range(layout.world_size)}
        self.failures: list[str] = []

    def expected(self, qkv: torch.Tensor, positions: torch.Tensor):
        return reference.prologue(
            qkv,
            positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            **self.full.spec.kwargs(),
        )

    def _slices(self, tp_rank: int, exact):
        d = self.full.head_dim
        qh, kvh = shard_heads(self.shard, tp_rank)
        q, k, v = exact
        return (
            q[:, qh.start * d : qh.stop * d],
            k[:, kvh.start * d : kvh.stop * d],
            v[:, kvh.start * d : kvh.stop * d],
        )

    def _check(self, what: str, qkv: torch.Tensor, positions: torch.Tensor, outputs: dict) -> bool:
        """Check ``outputs`` (``{rank: (q, k, v)}``, ranks of one DP replica or all replicas
        for the probe) against the expectation of ``qkv`` rows, a chunk of tokens at a time:
        the float64 expectation and the ULP comparison of a whole batch would take ~100 bytes
        per qkv element (4 GiB at 64K Qwen3-8B tokens)."""
        d = self.full.head_dim
        step = max(1, VERIFY_CHUNK_ELEMENTS // self.full.spec.qkv_width)
        problems: dict[int, dict[str, list]] = {r: {} for r in outputs}
        v_mismatch: set[int] = set()
        ulp = dict.fromkeys(outputs, 0)
        rel = dict.fromkeys(outputs, 0.0)
        ratio = dict.fromkeys(outputs, 0.0)
        for start in range(0, qkv.shape[0], step):
            rows = slice(start, start + step)
            exact = self.expected(qkv[rows], positions[rows])
            for rank, outs in outputs.items():
                q_exp, k_exp, v_exp = self._slices(self.layout.coords(rank)[1], exact)
                for name, out, ref in (("q", outs[0], q_exp), ("k", outs[1], k_exp)):
                    c = compare(out[rows].cpu(), ref, head_dim=d, numerics=self.numerics)
                    ulp[rank] = max(ulp[rank], c.max_ulp or 0)
                    rel[rank] = max(rel[rank], c.max_rel_head)
                    ratio[rank] = max(ratio[rank], c.error_ratio or 0.0)
                    if not c.passed:
                        problems[rank].setdefault(name, []).append(c)
                if not torch.equal(outs[2][rows].cpu(), v_exp):
                    v_mismatch.add(rank)
        ok = True
        for rank in outputs:
            stats = self.ranks[rank]
            stats.checks += 1
            stats.max_ulp = max(stats.max_ulp, ulp[rank])
            stats.max_rel = max(stats.max_rel, rel[rank])
            stats.max_err_ratio = max(stats.max_err_ratio, ratio[rank])
            lines = [_describe(name, cs) for name, cs in problems[rank].items()]
            if rank in v_mismatch:
                lines.append("v is not a bit-exact copy")
            if lines:
                self.failures.append(f"{what}: {self.layout.describe(rank)}: " + "; ".join(lines))
                ok = False
            else:
                stats.passed += 1
        return ok

    def check_step(self, plan: StepPlan, replies: dict[int, dict]) -> bool:
        """Check every rank's outputs of a verified ``plan``; True when all pass."""
        ok = True
        for dp_rank, batch in enumerate(plan.batches):
            tokens = sum(s.length for s in batch)
            if tokens == 0:
                continue
            positions = segment_positions(list(batch))
            qkv = step_qkv(self.seed, plan.step, dp_rank, tokens, self.full, self.dtype)
            ranks = [self.layout.rank(dp_rank, t) for t in range(self.layout.tp)]
            outputs = {r: replies[r]["outputs"] for r in ranks}
            ok &= self._check(f"step {plan.step}", qkv, positions, outputs)
        return ok & self.check_probe(plan.step, replies)

    def check_probe(self, step: int, replies: dict[int, dict]) -> bool:
        """The probe batch: correct on every rank, bit-identical across DP replicas."""
        positions = probe_positions(self.seed, step, self.full.max_position)
        qkv = step_qkv(self.seed, step, PROBE_STREAM, len(positions), self.full, self.dtype)
        probes = {r: replies[r]["probe"] for r in range(self.layout.world_size)}
        ok = self._check(f"step {step} probe", qkv, positions, probes)
        for tp_rank in range(self.layout.tp):
            first = self.layout.rank(0, tp_rank)
            for dp_rank in range(1, self.layout.dp):
                rank = self.layout.rank(dp_rank, tp_rank)
                same = all(
                    _bits_equal(a, b)
                    for a, b in zip(replies[first]["probe"], replies[rank]["probe"])
                )
                if same:
                    self.ranks[rank].probe_identical += 1
                else:
                    ok = False
                    self.failures.append(
                        f"step {step} probe: {self.layout.describe(rank)} differs bitwise from "
                        f"{self.layout.describe(first)} on the same input"
                    )
        return ok


def _describe(name: str, failed: list) -> str:
    """One output's failed chunks as one line (counts summed, maxima over the chunks)."""
    bad = sum(c.bad for c in failed)
    nonfinite = sum(c.nonfinite for c in failed)
    max_ulp = max((c.max_ulp for c in failed if c.max_ulp is not None), default=None)
    max_rel = max(c.max_rel_head for c in failed)
    return (
        f"{name}: {bad} elements outside {failed[0].tolerance}, max ulp {max_ulp}, "
        f"max err {max_rel:.3g} x head max" + (f", {nonfinite} non-finite" if nonfinite else "")
    )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
