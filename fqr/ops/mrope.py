"""mrope: multimodal rotary embedding (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

A token has three positions, one per plane: temporal ``t``, height ``h`` and width ``w``
(``positions [3, T]``; text tokens carry the same position in all three). Each rotary frequency
``i`` in ``[0, R/2)`` takes its angle from the row of one plane's position, chosen by
``mrope_section = (s_t, s_h, s_w)``:

* contiguous sections (Qwen2-VL, Qwen2.5-VL; ``s_t + s_h + s_w = R/2``): frequencies
  ``[0, s_t)`` from ``t``, ``[s_t, s_t + s_h)`` from ``h``, the rest from ``w``;
* interleaved (Qwen3-VL, Qwen3.5: ``mrope_interleaved``): frequency ``i`` from ``h`` when
  ``i % 3 == 1`` and ``i < 3 * s_h``, from ``w`` when ``i % 3 == 2`` and ``i < 3 * s_w``, from
  ``t`` otherwise (so ``t, h, w, t, h, w, ...`` until the h and w sections run out). Any
  non-negative sizes, read as vLLM reads them (``s_t`` is not read): ``(16, 24, 24)`` over 64
  frequencies gives t, h, w 22, 21 and 21 frequencies, ``(24, 20, 20)`` exactly 24, 20, 20.

With ``c, s`` the chosen cos and sin of each frequency, the rotation is :mod:`fqr.ops.rope`'s
(NeoX or GPT-J pairs, features past R pass through, the same ``round_to`` rounding), so three
equal planes give plain RoPE bit for bit. This is vLLM's ``MRotaryEmbedding.forward_native``
(``cos_sin_cache[positions]`` per plane, then ``torch.cat`` of the sections or
``apply_interleaved_rope``, then ``apply_rotary_emb``) and Hugging Face's
``Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope``; the float64 reference is
:func:`fqr.reference.mrope`.

The three planes are three ``[T]`` index operands (the public op passes the rows of
``positions [3, T]``); the kernel gathers each plane's table row and selects per frequency.
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadLayout, HeadOp, Role, primitive
from .common import table_rows
from .rope import _rope_abstract, emit_rotation, rotate_by_rows

mrope_p = primitive("mrope")


def frequency_planes(half: int, sections: tuple[int, int, int], interleaved: bool) -> list[int]:
    """The plane (0 = t, 1 = h, 2 = w) each of the ``half`` frequencies takes its angle from."""
    s_t, s_h, s_w = sections
    if interleaved:
        return [
            1 if i % 3 == 1 and i < 3 * s_h else 2 if i % 3 == 2 and i < 3 * s_w else 0
            for i in range(half)
        ]
    return [0 if i < s_t else 1 if i < s_t + s_h else 2 for i in range(half)]


def mrope(
    x,
    positions_t,
    positions_h,
    positions_w,
    cos_sin_cache,
    *,
    head_dim: int,
    mrope_section,
    mrope_interleaved: bool = False,
    is_neox: bool = True,
    round_to: torch.dtype | None = None,
):
    """See the module docstring: ``x [T, H*head_dim]`` rotated by the angles of the three
    position planes ``positions_t/h/w [T]``."""
    return mrope_p.bind(
        x,
        positions_t,
        positions_h,
        positions_w,
        cos_sin_cache,
        d=int(head_dim),
        sections=tuple(int(s) for s in mrope_section),
        interleaved=bool(mrope_interleaved),
        neox=bool(is_neox),
        round_to=round_to,
    )


@mrope_p.def_abstract
def _mrope_abstract(x: Aval, pt: Aval, ph: Aval, pw: Aval, cache: Aval, **params):
    for plane in (pt, ph, pw):
        _rope_abstract(x, plane, cache, d=params["d"], neox=params["neox"], round_to=None)
    rotary_dim = cache.shape[1]
    assert isinstance(rotary_dim, int)
    half = rotary_dim // 2
    sections = params["sections"]
    if min(sections) < 0 or (not params["interleaved"] and sum(sections) != half):
        raise ValueError(
            f"mrope_section {list(sections)} does not give its frequencies to the {half} of "
            f"rotary_dim {rotary_dim} (contiguous sections sum to {half}; interleaved ones "
            f"are non-negative)"
        )
    return Aval(x.shape, x.dtype)


@mrope_p.def_impl
def _mrope_impl(x, pt, ph, pw, cache, *, d, sections, interleaved, neox, round_to):
    r = cache.shape[1]
    planes = frequency_planes(r // 2, sections, interleaved)
    choice = torch.tensor(planes + planes, device=cache.device)  # cos and sin columns
    per_plane = torch.stack([table_rows(cache, p) for p in (pt, ph, pw)])
    rows = per_plane.gather(0, choice.expand(1, pt.shape[0], r)).squeeze(0)
    return rotate_by_rows(x, rows, d=d, neox=neox, round_to=round_to)


@mrope_p.def_facts
def _mrope_facts(x: Aval, pt: Aval, ph: Aval, pw: Aval, cache: Aval, *, d, neox, **_) -> HeadOp:
    rotary_dim = cache.shape[1]
    assert isinstance(rotary_dim, int)
    return HeadOp(
        (Role.VALUE, Role.INDEX, Role.INDEX, Role.INDEX, Role.TABLE),
        head_dim=d,
        layout=HeadLayout(rotary_dim, "neox" if neox else "gptj"),
    )


@mrope_p.def_lowering
def _mrope_lowering(b: EmitContext, eqn: Eqn) -> None:
    # Each plane's cos and sin row is gathered (shared by every chain of the tile); a
    # frequency's angle is selected from its plane, then rope's rotation runs unchanged.
    x_var, pt, ph, pw, cache_var = eqn.inputs
    assert x_var is not None and pt is not None and ph is not None and pw is not None
    assert cache_var is not None
    x = b.pieces(x_var)
    rotary_dim = cache_var.aval.shape[1]
    assert isinstance(rotary_dim, int)
    half = rotary_dim // 2
    s_t, s_h, s_w = eqn.params["sections"]
    i = b.fresh("freq")
    b.emit(f"{i} = tl.arange(0, {1 << (half - 1).bit_length()})[None, None, :]")
    on_h, on_w = b.fresh("on_h"), b.fresh("on_w")
    if eqn.params["interleaved"]:
        b.emit(f"{on_h} = (({i} % 3) == 1) & ({i} < {3 * s_h})")
        b.emit(f"{on_w} = (({i} % 3) == 2) & ({i} < {3 * s_w})")
    else:
        b.emit(f"{on_h} = ({i} >= {s_t}) & ({i} < {s_t + s_h})")
        b.emit(f"{on_w} = {i} >= {s_t + s_h}")
    angles = []
    for start, what in ((0, "cos"), (half, "sin")):
        t, h, w = (
            b.gather(cache_var, p, start, half, name=f"{what}{k}")
            for k, p in zip("thw", (pt, ph, pw))
        )
        chosen = b.fresh(what)
        b.emit(f"{chosen} = tl.where({on_h}, {h}, tl.where({on_w}, {w}, {t}))")
        angles.append(chosen)
    emit_rotation(b, eqn, x, angles[0], angles[1])
