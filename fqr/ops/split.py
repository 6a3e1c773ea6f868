"""split_heads: cut a packed activation row into head-structured values; split_qkv on top of it.

``split_heads(packed, sections)`` returns one new contiguous ``[T, heads * head_dim]`` tensor
per :class:`~fqr.core.Section` ``(heads, head_dim, offset, head_stride)``: head ``h`` of a
section is ``packed[:, offset + h*head_stride : offset + h*head_stride + head_dim]``. So one
primitive covers every packed layout the models use:

* vLLM's ``qkv.split([q_size, kv_size, kv_size], dim=-1)``: three back-to-back sections
  (:func:`split_qkv`); k and v may have different head counts or head dims;
* Qwen3.5's gated attention ``[q0 g0 q1 g1 ... | k | v]``: q and the gate are two sections of
  stride ``2*D`` (offsets 0 and D);
* MiniMax-M3's indexer heads: more sections, with their own head_dim;
* padded heads ``[T, H, D + pad]``: a stride ``D + pad``.

Sections may not overlap, and each must lie inside the row; columns no section names (padding)
are not read. Lowering: the outputs are views (:class:`~fqr.core.Views`), each loaded from the
packed row where the fused kernel first uses it; nothing is emitted for the split itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core import Aval, Section, Views, primitive, qkv_sections

split_heads_p = primitive("split_heads", multiple_results=True)


def split_heads(packed, sections: Sequence[Section]):
    """One new contiguous ``[T, heads*head_dim]`` tensor per section (module docstring)."""
    sections = tuple(sections)
    for i, s in enumerate(sections):
        if not isinstance(s, Section):
            raise TypeError(f"sections[{i}] must be a fqr.core.Section, got {type(s).__name__}")
    return split_heads_p.bind(packed, sections=sections)


def split_qkv(
    qkv,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_v_heads: int | None = None,
    v_head_dim: int | None = None,
    head_stride: int | None = None,
):
    """``(q [T, Hq*D], k [T, Hkv*D], v [T, Hv*Dv])`` from the packed row: vLLM's
    ``qkv.split([q_size, kv_size, v_size], dim=-1)``, as three back-to-back sections
    (``Hv``, ``Dv`` default to k's). ``head_stride`` (>= both head dims): every head of the row
    starts ``head_stride`` columns after the previous one (a padded ``[T, heads, head_stride]``
    layout; the padding is not read). The sections are :func:`fqr.core.qkv_sections`'."""
    hv = num_kv_heads if num_v_heads is None else num_v_heads
    dv = head_dim if v_head_dim is None else v_head_dim
    for name, v in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_v_heads", hv),
        ("v_head_dim", dv),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if head_stride is not None and (
        not isinstance(head_stride, int) or head_stride < max(head_dim, dv)
    ):
        raise ValueError(
            f"head_stride must be an int >= head_dim and v_head_dim, got {head_stride!r}"
        )
    sections = qkv_sections(
        num_heads, num_kv_heads, head_dim, num_v_heads=hv, v_head_dim=dv, head_stride=head_stride
    )
    if head_stride is None:
        width = sections[-1].end
        expected = f"num_heads*head_dim + num_kv_heads*head_dim + num_v_heads*v_head_dim = {width}"
    else:  # every head's padding, the last one's too
        width = (num_heads + num_kv_heads + hv) * head_stride
        expected = f"(num_heads + num_kv_heads + num_v_heads) * head_stride = {width}"
    if len(qkv.shape) == 2 and qkv.shape[1] != width:
        raise ValueError(f"qkv width {qkv.shape[1]} != {expected}")
    return split_heads(qkv, sections)


@split_heads_p.def_abstract
def _split_abstract(packed: Aval, *, sections: tuple[Section, ...]) -> list[Aval]:
    if packed.ndim != 2:
        raise ValueError(f"the packed row must be 2-D [T, width], got shape {list(packed.shape)}")
    if not packed.dtype.is_floating_point:
        raise TypeError(f"the packed row must be a floating tensor, got {packed.dtype}")
    if not sections:
        raise ValueError("sections must name at least one section")
    width = packed.shape[1]
    assert isinstance(width, int), "the packed row's width is static"
    heads = []
    for i, s in enumerate(sections):
        if s.end > width:
            raise ValueError(
                f"sections[{i}] ({s}) reads columns up to {s.end}, past the packed width {width}"
            )
        heads += [(start, end, i) for start, end in s.head_columns()]
    heads.sort()
    for (_, end, i), (start, _, j) in zip(heads, heads[1:]):
        if start < end:
            raise ValueError(
                f"sections[{i}] ({sections[i]}) and sections[{j}] ({sections[j]}) overlap at "
                f"column {start}"
            )
    t = packed.shape[0]
    return [Aval((t, s.width), packed.dtype) for s in sections]


@split_heads_p.def_impl
def _split_impl(packed: torch.Tensor, *, sections: tuple[Section, ...]) -> list[torch.Tensor]:
    outs = []
    for s in sections:
        heads = torch.arange(s.heads, device=packed.device)[:, None] * s.head_stride
        cols = (s.offset + heads + torch.arange(s.head_dim, device=packed.device)).flatten()
        outs.append(packed.index_select(1, cols))  # a new contiguous tensor
    return outs


@split_heads_p.def_facts
def _split_facts(packed: Aval, *, sections: tuple[Section, ...]) -> Views:
    return Views(sections)
