"""Real RoPE angle tables in vLLM's ``cos_sin_cache`` layout.

``cache[p] = [cos(p * f_0) .. cos(p * f_{R/2-1}), sin(p * f_0) .. sin(p * f_{R/2-1})]`` with
``f_i = 1 / theta^(2i / R)`` (R = rotary_dim), as vLLM's ``RotaryEmbedding._compute_cos_sin_cache``
builds it. The angles are computed in float64 and rounded once to ``dtype``, so the table is the
correctly rounded real table, not an fp32 approximation of it. ``scaling={"rope_type": "llama3",
...}`` applies Llama 3.1's frequency scaling (vLLM ``Llama3RotaryEmbedding``; Llama 4 Scout's
``low_freq_factor == high_freq_factor`` has no smooth band, as vLLM's ``smooth = 0``).
``scaling={"rope_type": "proportional", "partial_rotary_factor": f}`` is Gemma 4's full-attention
RoPE (vLLM ``Gemma4RotaryEmbedding``, HF ``_compute_proportional_rope_parameters``): the table
spans the whole head (``rotary_dim = head_dim``), its first ``int(head_dim * f) // 2``
frequencies are ``1 / theta^(2i / head_dim)`` and the rest are 0 (cos 1, sin 0: those pairs pass
through unrotated).
``{"rope_type": "linear", "factor": f}`` divides every position by ``f`` (vLLM
``LinearScalingRotaryEmbedding``).
``{"rope_type": "negated"}`` is the table of the negated positions (every frequency ``-f_i``: cos
as it is, sin negated, exactly): nanochat rotates by the negated angle (its ``rotate_half`` is
``cat(x2, -x1)``), which is the usual rotation given this table.

``{"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L, "beta_fast": b_f,
"beta_slow": b_s, "mscale": m, "mscale_all_dim": m_all}`` (optional ``"attn_factor"`` a,
``"extrapolation_factor"`` e) is the YaRN table of DeepSeek-V2/V3/V3.2 and Kimi-K2, as vLLM's
``DeepseekScalingRotaryEmbedding`` builds it (``get_rope`` type ``deepseek_yarn``, which
``DeepseekV2Attention`` / the MLA attention select for any non-default ``rope_type``):

* correction range: ``d(r) = R * ln(L / (2 pi r)) / (2 ln theta)``, ``low = max(floor(d(b_f)), 0)``,
  ``high = min(ceil(d(b_s)), R - 1)`` (vLLM ``yarn_find_correction_range``; the clamp is to R - 1,
  not R/2 - 1, as vLLM and HF both write it); with ``"truncate": False`` (gpt-oss; default True)
  the ends are not rounded: ``max(d(b_f), 0)``, ``min(d(b_s), R - 1)`` (HF's and vLLM's
  ``find_correction_range(..., truncate)``); ``high = low + 0.001`` when they are equal;
* ramp ``r_i = clamp((i - low) / (high - low), 0, 1)`` for ``i < R/2`` (``yarn_linear_ramp_mask``),
  extrapolation weight ``w_i = (1 - r_i) * e``;
* ``f_i = (f_i / s) * (1 - w_i) + f_i * w_i``: the fast pairs (``i <= low``) keep their frequency
  (extrapolation), the slow ones (``i >= high``) are divided by ``s`` (interpolation);
* cos and sin are multiplied by ``mscale = g(s, m) / g(s, m_all) * a`` with ``g(s, x) = 1`` for
  ``s <= 1`` else ``0.1 * x * ln(s) + 1`` (``yarn_get_mscale`` of ``deepseek_scaling_rope.py``):
  for ``mscale != 1`` the table holds ``cos * mscale`` and ``sin * mscale``, not unit vectors, as
  vLLM's ``cos_sin_cache`` does (the rotation also scales q_pe and k_pe). Every released
  checkpoint has ``m == m_all`` (1.0; 0.707 for V2-Lite), so its multiplier is exactly 1.

Missing keys take vLLM's defaults: ``beta_fast`` 32, ``beta_slow`` 1, ``mscale`` 1,
``mscale_all_dim`` 0 (``g = 1``), ``attn_factor`` 1, ``extrapolation_factor`` 1, ``truncate``
True. Any other key
is refused (a ValueError naming it). vLLM's table has ``L * s`` rows (163840 for DeepSeek-V3,
its ``max_position_embeddings``); here the caller chooses ``max_position`` / ``rows``.

Where the other references differ (fqr follows vLLM):

* Hugging Face ``_compute_yarn_parameters`` (``ROPE_INIT_FUNCTIONS["yarn"]``, used by
  ``DeepseekV3RotaryEmbedding``, which multiplies cos/sin by its ``attention_scaling``) has the
  same correction range, ramp and blend (in float32), but its multiplier is the config's
  ``attention_factor`` when given (refused here: vLLM's DeepSeek path ignores that key and
  multiplies by its own ``attn_factor``), else ``g(s, m) / g(s, m_all)`` only when both
  ``mscale`` and ``mscale_all_dim`` are given and non-zero, else ``g(s, 1)`` whatever ``mscale``
  says. The two agree when both are given (every checkpoint) or neither. HF also has
  ``truncate: false`` (gpt-oss: the correction range's ends as computed, no floor/ceil; vLLM's
  generic yarn reads it too, its DeepSeek path always truncates): the key ``truncate`` here
  (default True), reads a ``beta_fast`` / ``beta_slow`` of 0 as the default, has no
  ``extrapolation_factor``, and takes ``factor`` from ``max_position_embeddings / L`` when it
  is missing (vLLM and fqr require it).
* DeepSeek's own ``inference/model.py`` (``precompute_freqs_cis``, in the DeepSeek-V3 and
  V3.2-Exp repositories) blends the same frequencies (in float32, and only when ``max_seq_len >
  original_seq_len``) but keeps the table unit-length: its one ``mscale`` (1.0; 0.707 in V2-Lite's
  ``config_16B.json``, the value of both config keys) only enters the softmax scale, as
  ``g(s, mscale)^2``, where vLLM and HF put ``g(s, m_all)^2``. With ``m == m_all`` and ``a = 1``
  the three tables agree; for ``m != m_all`` there is no DeepSeek reference.
* vLLM's generic ``YaRNScalingRotaryEmbedding`` (type ``yarn``: Qwen, gpt-oss) builds the same
  table from a scaling without ``mscale`` / ``mscale_all_dim`` (its multiplier is ``g(s, 1) * a``)
  but has keys of its own (``truncate``, ``apply_yarn_scaling``): fqr's ``yarn`` is DeepSeek's.
* vLLM and HF compute the frequencies and angles in float32; this table is the float64 one
  rounded once (as for every other scaling here), the multiplier applied before the rounding.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from .validate import as_float, shown

# The keys of a yarn scaling (fqr.rope_cache builds exactly these; others are refused).
YARN_KEYS = (
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attn_factor",
    "extrapolation_factor",
    "truncate",
)
# vLLM DeepseekScalingRotaryEmbedding's defaults for the optional ones.
YARN_DEFAULTS = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "attn_factor": 1.0,
    "extrapolation_factor": 1.0,
    "truncate": True,
}


# ------------------------------------------------------------------- checks of the parameters
# A preset's (and a model config's) RoPE parameters are checked before any table is built: a
# theta or factor of 0 or NaN gave a NaN table, a low_freq_factor or beta of 0 a
# ZeroDivisionError. Each check returns the value as the Python number it holds (numpy numbers
# included) and raises a TypeError (not a number) or ValueError (out of range) naming it.


def _shown(value) -> str:
    return shown(value) if isinstance(value, numbers.Real) else f"{type(value).__name__} {value!r}"


def _real(name: str, value, rule: str) -> float:
    """``value`` as a float (one past float's range as +-inf: :func:`fqr.validate.as_float`,
    which the caller's range check refuses)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {rule}, got {_shown(value)}")
    return as_float(value)


def positive_number(name: str, value) -> float:
    """A finite real number > 0."""
    v = _real(name, value, "a finite number > 0")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {_shown(value)}")
    return v


def nonnegative_number(name: str, value) -> float:
    """A finite real number >= 0."""
    v = _real(name, value, "a finite number >= 0")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {_shown(value)}")
    return v


def fraction(name: str, value) -> float:
    """A finite real number in ``(0, 1]`` (the part of a head that is rotated)."""
    v = _real(name, value, "a finite number in (0, 1]")
    if not 0 < v <= 1:  # nan fails it too
        raise ValueError(f"{name} must be a finite number in (0, 1], got {_shown(value)}")
    return v


def boolean(name: str, value) -> bool:
    """``value`` as a bool (a bool only: a yarn scaling's ``truncate``); else a TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {shown(value)}")
    return value


def positive_count(name: str, value) -> int:
    """An int >= 1 (a numpy integer too; not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {_shown(value)}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {_shown(value)}")
    return int(value)


# The keys of each scaling (besides ``rope_type``), each with its check, and those required.
SCALING_KEYS: dict[str, dict[str, Callable[[str, object], float]]] = {
    "linear": {"factor": positive_number},
    "llama3": {
        "factor": positive_number,
        "low_freq_factor": positive_number,
        "high_freq_factor": positive_number,
        "original_max_position_embeddings": positive_count,
    },
    "proportional": {"partial_rotary_factor": fraction},
    "negated": {},
    "yarn": {
        "factor": positive_number,
        "original_max_position_embeddings": positive_count,
        "beta_fast": positive_number,
        "beta_slow": positive_number,
        "mscale": nonnegative_number,
        "mscale_all_dim": nonnegative_number,
        "attn_factor": positive_number,
        "extrapolation_factor": nonnegative_number,
        "truncate": boolean,
    },
}
SCALING_REQUIRED = {
    "linear": ("factor",),
    "llama3": tuple(SCALING_KEYS["llama3"]),
    "proportional": ("partial_rotary_factor",),
    "negated": (),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def check_rope(
    theta,
    scaling: dict,
    *,
    theta_name: str = "theta",
    key_name: Callable[[str], str] = lambda key: f"scaling[{key!r}]",
) -> dict:
    """Check a table's ``theta`` (finite, > 0) and ``scaling`` (empty, or one of
    :data:`SCALING_KEYS` with its required keys, no other key, each value checked; a yarn
    scaling also needs ``theta != 1``: its correction range divides by ``ln(theta)``).
    Errors name ``theta_name`` and ``key_name(key)``. Returns the scaling with its values as
    Python numbers."""
    theta = positive_number(theta_name, theta)
    if not scaling:
        return {}
    rope_type = scaling.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in SCALING_KEYS:
        raise ValueError(
            f"{key_name('rope_type')} must be one of {', '.join(SCALING_KEYS)}, got {rope_type!r}"
        )
    checks = SCALING_KEYS[rope_type]
    for key in scaling:
        if key != "rope_type" and key not in checks:
            raise ValueError(
                f"{key_name(key)}: a {rope_type} scaling takes only {', '.join(checks)}"
            )
    for key in SCALING_REQUIRED[rope_type]:
        if key not in scaling:
            required = ", ".join(SCALING_REQUIRED[rope_type])
            raise ValueError(f"{key_name(key)} is missing: a {rope_type} scaling needs {required}")
    checked = {"rope_type": rope_type} | {
        key: checks[key](key_name(key), value) for key, value in scaling.items() if key in checks
    }
    if rope_type == "yarn" and theta == 1:
        raise ValueError(
            f"{theta_name} must not be 1 with a yarn scaling (its correction range divides by "
            f"ln({theta_name}))"
        )
    return checked


def _yarn_params(scaling: dict) -> dict:
    """The yarn scaling with vLLM's defaults filled in; unknown or missing required keys raise."""
    unknown = sorted(set(scaling) - set(YARN_KEYS))
    if unknown:
        raise ValueError(
            f"yarn scaling: unsupported key(s) {', '.join(unknown)} (vLLM's DeepSeek YaRN reads "
            f"only {', '.join(YARN_KEYS[1:])})"
        )
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"yarn scaling: missing {', '.join(missing)}")
    return YARN_DEFAULTS | dict(scaling)


def _yarn_mscale_term(factor: float, mscale: float) -> float:
    """``g(s, x)``: 1 for ``s <= 1``, else ``0.1 * x * ln(s) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_scale(scaling: dict | None) -> float:
    """The factor the table's cos and sin are multiplied by: YaRN's
    ``g(s, mscale) / g(s, mscale_all_dim) * attn_factor``, 1.0 for every other scaling."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    p = _yarn_params(scaling)
    factor = float(p["factor"])
    return (
        _yarn_mscale_term(factor, float(p["mscale"]))
        / _yarn_mscale_term(factor, float(p["mscale_all_dim"]))
        * float(p["attn_factor"])
    )


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling):
    """YaRN's blend of ``inv_freq`` (module docstring), on ``inv_freq``'s device."""
    p = _yarn_params(scaling)
    original = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(float(p["beta_fast"])), correction_dim(float(p["beta_slow"]))
    if p["truncate"]:  # vLLM's DeepSeek path always; HF's unless ``truncate: false``
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    i = torch.arange(rotary_dim // 2, dtype=torch.float64, device=inv_freq.device)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    extrapolated = (1.0 - ramp) * float(p["extrapolation_factor"])
    return inv_freq / float(p["factor"]) * (1.0 - extrapolated) + inv_freq * extrapolated


def inverse_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """float64 ``[rotary_dim/2]`` frequencies ``f_i`` of ``scaling`` (module docstring), on
    ``device`` (default: the CPU)."""
    even = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    inv_freq = 1.0 / (theta ** (even / rotary_dim))
    if scaling and scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low) if high != low else 0.0 * wavelen
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif scaling and scaling.get("rope_type") == "linear":
        # positions divided by the factor (vLLM LinearScalingRotaryEmbedding; Gemma 3 27B)
        inv_freq = inv_freq / scaling["factor"]
    elif scaling and scaling.get("rope_type") == "proportional":
        rotated = int(rotary_dim * scaling["partial_rotary_factor"]) // 2
        inv_freq[rotated:] = 0.0
    elif scaling and scaling.get("rope_type") == "negated":
        inv_freq = -inv_freq  # the negated positions' angles (module docstring)
    elif scaling and scaling.get("rope_type") == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, rotary_dim, theta, scaling)
    elif scaling:
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    return inv_freq


def rope_angles(
    positions: torch.Tensor, rotary_dim: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """float64 angles ``[len(positions), rotary_dim/2]``, on the positions' device."""
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling, device=positions.device)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    theta: float,
    scaling: dict | None = None,
    dtype=torch.float32,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` table (or only ``rows`` of it, when given): cos and sin
    of the float64 angles, times :func:`cos_sin_scale` (YaRN's mscale; 1 otherwise), rounded
    once to ``dtype``; on the device of ``rows`` (the CPU without them), every step there.
    ``theta`` and ``scaling`` are checked first (:func:`check_rope`: a NaN or a 401-digit
    ``theta`` is a ValueError naming it, not a NaN table or an ``OverflowError``)."""
    positive_count("rotary_dim", rotary_dim)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if rows is None:
        positive_count("max_position", max_position)
    scaling = check_rope(theta, scaling or {})
    theta = float(theta)  # checked finite: an int theta as float64 (torch takes ints as int64)
    positions = torch.arange(max_position) if rows is None else rows
    angles = rope_angles(positions, rotary_dim, theta, scaling)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    scale = cos_sin_scale(scaling)
    if scale != 1.0:
        table = table * scale
    return table.to(dtype)
