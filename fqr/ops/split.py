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
* padded heads ``[T, H, D + pad]``: a stride ``D + pad``;
* the rows checkpoints store without vLLM's load-time permutation (:func:`qkv_layout_sections`):
  GPT-NeoX's / Persimmon's per-head ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``qkv_layout=
  "per-head"``: three sections of stride ``3*D``) and CodeGen's row of ``N`` model-parallel
  shards, each ``[q_g | v_g | k_g]`` of ``H/N`` heads (``"codegen-mpN"``: sections of grouped
  heads).

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


QKV_LAYOUTS = ("qkv", "per-head", "codegen-mp<N>")  # for messages: the layout names


def codegen_shards(layout: str) -> int | None:
    """``N`` of a ``"codegen-mpN"`` layout name (a positive int), None for any other string."""
    prefix = "codegen-mp"
    if not isinstance(layout, str) or not layout.startswith(prefix):
        return None
    digits = layout[len(prefix) :]
    if not digits.isdigit() or digits.startswith("0"):
        return None
    return int(digits)


def check_qkv_layout(layout, num_heads: int, num_kv_heads: int, name: str = "qkv_layout") -> None:
    """A ``ValueError`` naming ``name`` unless ``layout`` is a layout of the packed row that
    these head counts can have (:func:`qkv_layout_sections`)."""
    shards = codegen_shards(layout)
    if layout not in ("qkv", "per-head") and shards is None:
        raise ValueError(f"{name} must be one of {', '.join(QKV_LAYOUTS)}, got {layout!r}")
    if layout != "qkv" and num_kv_heads != num_heads:
        raise ValueError(
            f"{name}={layout!r} interleaves q, k and v head by head: it needs num_kv_heads == "
            f"num_heads, got {num_kv_heads} and {num_heads}"
        )
    if shards is not None and num_heads % shards:
        raise ValueError(
            f"{name}={layout!r}: {shards} model-parallel shards do not divide num_heads {num_heads}"
        )


def qkv_layout_sections(layout: str, num_heads: int, head_dim: int) -> tuple[Section, ...]:
    """The ``(q, k, v)`` sections of a packed row of ``num_heads`` heads of each (q, k and v
    alike) as a checkpoint stores it, read in place (no load-time permutation):

    * ``"per-head"``: GPT-NeoX, GPT-NeoX-Japanese, Persimmon (HF ``view(T, H, 3 * D)`` then
      ``chunk(3)``): head ``h``'s q, k and v side by side, ``[q_h | k_h | v_h]`` at ``3*D*h``;
    * ``"codegen-mpN"``: CodeGen (HF ``view(T, N, 3 * W)`` then ``split(W)`` as q, v, k, with
      ``W = H*D/N``): ``N`` shards, each ``[q_g | v_g | k_g]`` of ``H/N`` heads, q head ``h`` in
      shard ``h // (H/N)``.

    (``"qkv"``, vLLM's ``[q | k | v]``, is :func:`fqr.core.qkv_sections`.)"""
    d = head_dim
    if layout == "per-head":
        return tuple(Section(num_heads, d, i * d, 3 * d) for i in range(3))
    shards = codegen_shards(layout)
    if shards is None:
        raise ValueError(f"qkv_layout must be one of {', '.join(QKV_LAYOUTS)}, got {layout!r}")
    g = num_heads // shards
    local = g * d
    q, v, k = (Section(num_heads, d, i * local, d, g, 3 * local) for i in range(3))
    return q, k, v


def split_qkv(
    qkv,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_v_heads: int | None = None,
    v_head_dim: int | None = None,
    head_stride: int | None = None,
    layout: str = "qkv",
):
    """``(q [T, Hq*D], k [T, Hkv*D], v [T, Hv*Dv])`` from the packed row: vLLM's
    ``qkv.split([q_size, kv_size, v_size], dim=-1)``, as three back-to-back sections
    (``Hv``, ``Dv`` default to k's). ``head_stride`` (>= both head dims): every head of the row
    starts ``head_stride`` columns after the previous one (a padded ``[T, heads, head_stride]``
    layout; the padding is not read). The sections are :func:`fqr.core.qkv_sections`'.
    ``layout`` other than ``"qkv"``: a checkpoint's own row (:func:`qkv_layout_sections`; q, k
    and v of one head count and head_dim, no padding)."""
    if layout != "qkv":
        check_qkv_layout(layout, num_heads, num_kv_heads, "layout")
        if (num_v_heads, v_head_dim, head_stride) != (None, None, None):
            raise ValueError(
                f"layout={layout!r} has v heads like k's, back to back within their group: "
                "num_v_heads, v_head_dim and head_stride must be None"
            )
        sections = qkv_layout_sections(layout, num_heads, head_dim)
        width = 3 * num_heads * head_dim
        if len(qkv.shape) == 2 and qkv.shape[1] != width:
            raise ValueError(f"qkv width {qkv.shape[1]} != 3 * num_heads * head_dim = {width}")
        return split_heads(qkv, sections)
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
        starts = torch.tensor([s.head_start(h) for h in range(s.heads)], device=packed.device)
        cols = (starts[:, None] + torch.arange(s.head_dim, device=packed.device)).flatten()
        outs.append(packed.index_select(1, cols))  # a new contiguous tensor
    return outs


@split_heads_p.def_facts
def _split_facts(packed: Aval, *, sections: tuple[Section, ...]) -> Views:
    return Views(sections)
