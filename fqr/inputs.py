"""Random inputs of the prologue, deterministic per generator seed: the one generator behind the
golden cases, the bench, the runtime's workload and the tests.

Drawn in float64 and rounded once to the activation dtype, in this order (so a seed always gives
the same tensors, whichever of them a caller asks for):

1. :func:`random_qkv` -- per-head scales ``s_h ~ U(0.5, 3)`` (real models' heads differ in
   magnitude), then ``qkv[t, h, :] ~ s_h * N(0, 1)``;
2. :func:`random_positions` -- uniform over the RoPE table's rows (optionally the last row at
   token 0 and row 0 at token 1, so that the table's ends are always exercised);
3. :func:`random_norm_params` -- norm weights around their trained value (``1 + 0.2 N(0, 1)``,
   or ``0.2 N(0, 1)`` for Gemma-style ``(1 + w)`` weights stored as ``w``), biases
   ``0.05 N(0, 1)``.

A projected call (:mod:`fqr.prologue.projected`) takes the hidden states and the projection
in place of ``qkv``: :func:`random_projection` draws them after the rest of its inputs.

The angle table is the model's real one (:meth:`fqr.presets.Preset.cos_sin_cache`), never
random.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .presets import PrologueSpec

F64 = torch.float64
WEIGHT_STD = 0.2
BIAS_STD = 0.05


@dataclass
class PrologueInputs:
    """The tensors of one call of :func:`fqr.split_qkv_rmsnorm_rope` and the spec they fit."""

    spec: PrologueSpec
    qkv: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None

    def args(self) -> tuple:
        """The positional arguments: ``(qkv, positions, cos_sin_cache, q_weight, k_weight)``."""
        return (self.qkv, self.positions, self.cos_sin_cache, self.q_weight, self.k_weight)

    def kwargs(self, **extra) -> dict:
        """The keyword arguments (the spec's, the biases), with ``extra``."""
        return self.spec.kwargs(q_bias=self.q_bias, k_bias=self.k_bias) | extra

    def operands(self) -> list[torch.Tensor]:
        """The tensors a traced prologue program takes, in order, absent ones left out."""
        tensors = self.args() + (self.q_bias, self.k_bias)
        return [t for t in tensors if t is not None]

    def to(self, device: torch.device | str) -> PrologueInputs:
        """The same inputs on ``device`` (each tensor moved as torch moves it)."""
        moved = {
            name: None if t is None else t.to(device)
            for name, t in vars(self).items()
            if name != "spec"
        }
        return PrologueInputs(self.spec, **moved)

    @property
    def tokens(self) -> int:
        return self.qkv.shape[0]


def random_qkv(
    spec: PrologueSpec,
    tokens: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> torch.Tensor:
    """Packed rows ``[tokens, spec.qkv_width]`` in ``dtype`` on the generator's device."""
    device = generator.device
    heads = spec.num_heads + 2 * spec.num_kv_heads
    scale = 0.5 + 2.5 * torch.rand(heads, generator=generator, dtype=F64, device=device)
    qkv = torch.randn(tokens, heads, spec.head_dim, generator=generator, dtype=F64, device=device)
    return (qkv * scale[:, None]).reshape(tokens, spec.qkv_width).to(dtype)


# The projection bias's spread (Qwen2's and GPT-NeoX's qkv biases are of the products' order).
PROJECTION_BIAS_STD = 0.5


def random_projection(
    tokens: int,
    hidden: int,
    width: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    bias: bool = False,
) -> dict[str, torch.Tensor]:
    """``{"x", "w_qkv"}`` (and ``"qkv_bias"`` with ``bias``) of a projected call, in ``dtype``:
    ``x [tokens, hidden] ~ N(0, 1)``, each row ``n`` of ``w_qkv [width, hidden]`` scaled as
    :func:`random_qkv` scales a head (``s_n ~ U(0.5, 3)``) over ``sqrt(hidden)``, so the packed
    row ``x @ w_qkv.T`` has the magnitudes of a drawn ``qkv``; the bias
    ``PROJECTION_BIAS_STD N(0, 1)``."""
    device = generator.device
    x = torch.randn(tokens, hidden, generator=generator, dtype=F64, device=device)
    scale = 0.5 + 2.5 * torch.rand(width, generator=generator, dtype=F64, device=device)
    w = torch.randn(width, hidden, generator=generator, dtype=F64, device=device)
    drawn = {"x": x.to(dtype), "w_qkv": (w * (scale / hidden**0.5)[:, None]).to(dtype)}
    if bias:
        b = torch.randn(width, generator=generator, dtype=F64, device=device)
        drawn["qkv_bias"] = (PROJECTION_BIAS_STD * b).to(dtype)
    return drawn


def random_positions(
    tokens: int,
    max_position: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.int64,
    cover_ends: bool = False,
) -> torch.Tensor:
    """``[tokens]`` positions in ``[0, max_position)``; with ``cover_ends`` token 0 reads the
    table's last row and (from 3 tokens on) token 1 its first."""
    positions = torch.randint(
        0, max_position, (tokens,), generator=generator, device=generator.device
    )
    if cover_ends and tokens:
        positions[0] = max_position - 1
        if tokens > 2:
            positions[1] = 0
    return positions.to(dtype)


def random_norm_params(
    spec: PrologueSpec,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    bias: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``(q_weight, k_weight, q_bias, k_bias)`` of ``spec``'s norm in ``dtype`` (None where the
    spec has no norm, or ``bias`` is off)."""
    if spec.norm_widths is None:
        return None, None, None, None
    device = generator.device

    def draw(n: int, std: float, centre: float) -> torch.Tensor:
        noise = torch.randn(n, generator=generator, dtype=F64, device=device)
        return (centre + std * noise).to(dtype)

    centre = 0.0 if spec.weight_offset else 1.0
    n_q, n_k = spec.norm_widths
    weights = draw(n_q, WEIGHT_STD, centre), draw(n_k, WEIGHT_STD, centre)
    biases = (draw(n_q, BIAS_STD, 0.0), draw(n_k, BIAS_STD, 0.0)) if bias else (None, None)
    return weights + biases


def random_norm_inputs(
    spec: PrologueSpec, dtype: torch.dtype, generator: torch.Generator, *, bias: bool = False
) -> dict[str, torch.Tensor]:
    """:func:`random_norm_params` by parameter name (``q_weight``, ``k_weight``, and
    ``q_bias`` / ``k_bias`` with ``bias``); none without a norm."""
    names = ("q_weight", "k_weight", "q_bias", "k_bias")
    norm = random_norm_params(spec, dtype, generator, bias=bias)
    return {n: x for n, x in zip(names, norm) if x is not None}


def random_inputs(
    spec: PrologueSpec,
    tokens: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    cos_sin_cache: torch.Tensor,
    *,
    bias: bool = False,
    positions_dtype: torch.dtype = torch.int64,
    cover_ends: bool = False,
) -> PrologueInputs:
    """A whole call's inputs on the generator's device, positions into ``cos_sin_cache``."""
    if cos_sin_cache.shape[-1] != spec.rotary_dim:
        raise ValueError(
            f"cos_sin_cache is {cos_sin_cache.shape[-1]} wide, the spec's rotary_dim is "
            f"{spec.rotary_dim}"
        )
    qkv = random_qkv(spec, tokens, dtype, generator)
    positions = random_positions(
        tokens,
        cos_sin_cache.shape[0],
        generator,
        dtype=positions_dtype,
        cover_ends=cover_ends,
    )
    norm = random_norm_params(spec, dtype, generator, bias=bias)
    return PrologueInputs(spec, qkv, positions, cos_sin_cache.to(generator.device), *norm)


def random_heads(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """``[tokens, heads*head_dim]`` drawn as :func:`random_qkv` draws its heads."""
    device = generator.device
    scale = 0.5 + 2.5 * torch.rand(heads, generator=generator, dtype=F64, device=device)
    x = torch.randn(tokens, heads, head_dim, generator=generator, dtype=F64, device=device)
    return (x * scale[:, None]).reshape(tokens, heads * head_dim).to(dtype)


OUTLIERS = (-1000.0, 600.0, 449.0, -448.5)  # v entries past E4M3's +-448: the clamp is exercised


def with_outliers(x: torch.Tensor, columns: slice, generator: torch.Generator) -> torch.Tensor:
    """``x`` with :data:`OUTLIERS` written at random tokens of ``columns`` (a v section):
    activations real models produce now and then, and what an FP8 store must saturate."""
    if not x.shape[0]:
        return x
    x = x.clone()
    width = columns.stop - columns.start
    for value in OUTLIERS:  # indexed by tensors: no value read back to the host
        t = torch.randint(0, x.shape[0], (1,), generator=generator, device=generator.device)
        c = columns.start + torch.randint(
            0, width, (1,), generator=generator, device=generator.device
        )
        x[t, c] = value
    return x


def random_row(
    spec: PrologueSpec,
    tokens: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    max_position: int,
    positions_dtype: torch.dtype = torch.int64,
) -> dict[str, torch.Tensor]:
    """``{"qkv", "positions"}`` of one call (:func:`random_qkv`, then :func:`random_positions`
    covering the table's ends)."""
    qkv = random_qkv(spec, tokens, dtype, generator)
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )
    return {"qkv": qkv, "positions": positions}


def random_paged_cache(
    blocks: int, entry: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """A paged cache ``[blocks, *entry]`` (``entry`` = block size, then one slot's shape)
    holding ``N(0, 1)`` values in ``dtype``: a row written where no slot names it shows."""
    shape = (blocks, *entry)
    device = generator.device
    return torch.randn(shape, generator=generator, dtype=F64, device=device).to(dtype)


def random_slot_mapping(
    tokens: int, slots: int, generator: torch.Generator, *, padding_from: int = 1
) -> torch.Tensor:
    """``[tokens]`` distinct slots of ``[0, slots)``, every third one from ``padding_from``
    on negative (padding tokens: nothing stored), as a serving engine's slot mapping."""
    mapping = torch.randperm(slots, generator=generator, device=generator.device)[:tokens]
    if tokens > 1:
        mapping[padding_from::3] = -1
    return mapping


def random_fp8_scales(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``{"k_scale", "v_scale"}``: float32 ``[1]`` per-tensor scales of an FP8 KV cache,
    uniform in ``[0.25, 1)``."""
    device = generator.device
    scales = 0.25 + 0.75 * torch.rand(2, generator=generator, dtype=F64, device=device)
    return {"k_scale": scales[:1].float(), "v_scale": scales[1:].float()}


def random_index_row(
    spec: PrologueSpec,
    tokens: int,
    num_index_heads: int,
    index_head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    max_position: int,
    positions_dtype: torch.dtype = torch.int64,
) -> dict[str, torch.Tensor]:
    """One call of MiniMax-M3's indexer prologue: the row ``[q | k | v | index_q | index_k]``
    (:func:`random_qkv`, then ``num_index_heads + 1`` heads of ``index_head_dim``, v with
    :data:`OUTLIERS`), positions covering the table's ends, then the norm weights of q and k
    and of index_q and index_k (drawn in this order)."""
    main = random_qkv(spec, tokens, dtype, generator)
    index = random_heads(tokens, num_index_heads + 1, index_head_dim, dtype, generator)
    v_at = spec.q_size + spec.kv_size
    v_columns = slice(v_at, v_at + spec.kv_size)
    qkv = with_outliers(torch.cat([main, index], dim=1), v_columns, generator)
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )
    q_weight, k_weight, _, _ = random_norm_params(spec, dtype, generator)
    index_spec = replace(
        spec, num_heads=1, num_kv_heads=1, head_dim=index_head_dim, rotary_dim=index_head_dim
    )
    iq_weight, ik_weight, _, _ = random_norm_params(index_spec, dtype, generator)
    return {
        "qkv": qkv,
        "positions": positions,
        "q_weight": q_weight,
        "k_weight": k_weight,
        "index_q_weight": iq_weight,
        "index_k_weight": ik_weight,
    }
