"""The synthetic workload: requests, and the tensors of a step drawn from seeds.

Requests have a prompt length drawn uniformly from ``prompt_len = (a, b)``, ``decode_steps``
decode tokens, and Poisson arrivals (``arrivals_per_step`` on average). A step's batch is a
list of :class:`Segment` s (a prefill chunk or one decode token of a request, with its real
positions). The activations are not shipped: every process that needs a step's packed QKV
rows (its workers, and the verifier) draws them from ``(seed, step, stream)``, where the
stream is the DP rank (or :data:`PROBE_STREAM` for the probe batch every DP replica runs).
Norm weights are drawn once from the seed, for the whole (unsharded) model. Both come from
:mod:`fqr.inputs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..inputs import random_norm_params, random_qkv
from ..presets import Preset

PROBE_STREAM = 1 << 20
PROBE_TOKENS = 8


@dataclass(frozen=True)
class RequestSpec:
    req_id: int
    prompt_len: int
    decode_steps: int
    arrival_step: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_len + self.decode_steps


@dataclass(frozen=True)
class Segment:
    """``length`` tokens of request ``req_id`` at positions ``start .. start+length-1``."""

    req_id: int
    start: int
    length: int


def parse_range(text: str, name: str = "prompt-len") -> tuple[int, int]:
    """``"16..96"`` (or ``"64"``) -> ``(16, 96)``."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+))?\s*", str(text))
    if not m:
        raise ValueError(f"--{name} must look like A..B or N, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1 or hi < lo:
        raise ValueError(f"--{name} needs 1 <= A <= B, got {text!r}")
    return lo, hi


def synthetic_requests(
    n: int,
    prompt_len: tuple[int, int],
    decode_steps: int,
    seed: int,
    arrivals_per_step: float = 2.0,
) -> list[RequestSpec]:
    if n < 1:
        raise ValueError(f"--requests must be >= 1, got {n}")
    if decode_steps < 0:
        raise ValueError(f"--decode-steps must be >= 0, got {decode_steps}")
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_len[0], prompt_len[1] + 1, (n,), generator=g)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(arrivals_per_step, generator=g)
    arrivals = torch.cumsum(gaps, 0).floor().long() - int(gaps[0].floor())
    return [RequestSpec(i, int(lens[i]), decode_steps, int(arrivals[i])) for i in range(n)]


def _generator(seed: int, step: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 8191 + stream) % (1 << 62))


def segment_positions(segments: list[Segment]) -> torch.Tensor:
    if not segments:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])


def probe_positions(seed: int, step: int, max_position: int) -> torch.Tensor:
    """Positions of the probe batch: spread over the whole RoPE table (large angles too)."""
    g = _generator(seed, step, PROBE_STREAM + 1)
    return torch.randint(0, max_position, (PROBE_TOKENS,), generator=g)


def step_qkv(
    seed: int, step: int, stream: int, tokens: int, preset: Preset, dtype: torch.dtype
) -> torch.Tensor:
    """The packed, unsharded QKV rows ``[tokens, (Hq + 2*Hkv) * D]`` of one batch (CPU)."""
    if preset.tp != 1:
        raise ValueError("step_qkv draws the unsharded rows: pass the tp=1 preset")
    return random_qkv(preset.spec, tokens, dtype, _generator(seed, step, stream))


def model_norm_weights(preset: Preset, seed: int, dtype: torch.dtype):
    """``(q_weight, k_weight)`` of the unsharded model (:func:`fqr.inputs.random_norm_params`):
    ``[D]`` each for per-head norm, ``[Hq*D]``/``[Hkv*D]`` for full-width norm, ``(None, None)``
    without QK norm."""
    if preset.tp != 1:
        raise ValueError("model_norm_weights draws the unsharded weights: pass the tp=1 preset")
    q_weight, k_weight, _, _ = random_norm_params(
        preset.spec, dtype, torch.Generator().manual_seed(seed ^ 0x5EED)
    )
    return q_weight, k_weight
