"""Split coalescing: the pieces that separate splits and slices cut from one tensor, made one
``split_with_sizes`` before the fusion patterns run.

Model code does not always split the packed QKV row in one call::

    q, _, _ = qkv.split([q_size, kv_size, kv_size], -1)       q = qkv[:, :q_size]
    _, k, _ = qkv.split([q_size, kv_size, kv_size], -1)  or   k = qkv[:, q_size:q_size + kv_size]
    _, _, v = qkv.split([q_size, kv_size, kv_size], -1)       v = qkv[:, q_size + kv_size:]

Inductor's CSE does not merge the first form on every build (vLLM issue 33295, PyTorch
174472) and never turns the second into a split, so the graph holds three nodes where the
patterns expect one ``split_with_sizes(qkv, [q_size, kv_size, kv_size], -1)``. vLLM runs its
``SplitCoalescingPass`` (duplicate splits with equal sizes) before its QK-norm-RoPE fusion;
:func:`coalesce_splits` does that and also handles slices and nested splits:

1. every *derived piece* of a tensor along a dim with static bounds (a ``slice`` with step 1;
   a piece of a split of a piece, ``kv.split([kv_size, kv_size])`` of ``qkv[:, q_size:]``) is
   an interval ``[start, end)`` of its root tensor. When these intervals contain chains that
   cover the dim exactly, the finest one becomes one new ``split_with_sizes`` right after the
   root, and every derived node holding one of its intervals is redirected to its piece.
   Pieces of the root's own splits are never redirected and never complete a chain (so a
   split that is already one node is not cut again), and an interval outside the chain (an
   unrelated ``qkv[:, :q_size + kv_size]``) keeps its node;
2. ``split_with_sizes`` nodes of one tensor with equal sizes and dim (also those step 1
   created beside the model's own): the later ones' pieces are redirected to the first one's.

Not handled: a chain that needs a piece of an existing split (``q, kv = qkv.split([q_size,
2 * kv_size])`` then ``k, v = kv.split(...)``); such a model stays unfused.

The fusion pass runs this on the model's graph, and the patterns are traced through it too
(:func:`fqr.fusion.patterns.trace_like_inductor`): the slices inside the prologue (RoPE's
rotated and passed-through features, NeoX's halves) take the same form in both.

Every rewrite replaces a view by an identical view (same offset, shape and strides), so the
graph computes the same values; the pieces left unused are removed by dead-code elimination.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch

aten = torch.ops.aten
Node = torch.fx.Node


@dataclass(frozen=True)
class Piece:
    """``root`` narrowed to ``[start, end)`` along ``dim`` (non-negative)."""

    root: Node
    dim: int
    start: int
    end: int
    derived: bool  # a slice or a nested piece (not a piece of a split of the root itself)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _static_dim_size(node: Node, dim: int) -> int | None:
    val = _val(node)
    if not isinstance(val, torch.Tensor) or dim >= val.dim():
        return None
    size = val.shape[dim]
    return size if type(size) is int else None


def _norm_dim(node: Node, dim) -> int | None:
    val = _val(node)
    if type(dim) is not int or not isinstance(val, torch.Tensor):
        return None
    rank = val.dim()
    if not -rank <= dim < rank:
        return None
    return dim % rank


def _split_sizes(node: Node) -> tuple[list[int], int] | None:
    """The sizes and dim of a split node (``split_with_sizes`` or ``split.Tensor``)."""
    if node.op != "call_function":
        return None
    if node.target is aten.split_with_sizes.default:
        sizes = node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif node.target is aten.split.Tensor:
        step = node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        d = _norm_dim(node.args[0], dim)
        total = None if d is None else _static_dim_size(node.args[0], d)
        if type(step) is not int or step < 1 or total is None:
            return None
        sizes = [min(step, total - i) for i in range(0, total, step)]
    else:
        return None
    d = _norm_dim(node.args[0], dim)
    if d is None or not all(type(s) is int for s in sizes):
        return None
    return list(sizes), d


def piece_of(node: Node, memo: dict) -> Piece | None:
    """The interval of its root tensor that ``node`` holds, if it is a static piece."""
    if node in memo:
        return memo[node]
    memo[node] = None
    piece = None
    if node.op == "call_function" and node.target is operator.getitem:
        split, index = node.args
        cut = _split_sizes(split) if isinstance(split, Node) else None
        if cut is not None and type(index) is int and 0 <= index < len(cut[0]):
            sizes, dim = cut
            start = sum(sizes[:index])
            piece = _narrow(split.args[0], dim, start, start + sizes[index], memo)
    elif node.op == "call_function" and node.target is aten.slice.Tensor:
        src = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        d = _norm_dim(src, dim)
        size = None if d is None else _static_dim_size(src, d)
        static = all(x is None or type(x) is int for x in (start, end))
        if step == 1 and size is not None and static:
            lo = 0 if start is None else (start + size if start < 0 else start)
            hi = size if end is None else (end + size if end < 0 else end)
            lo, hi = max(0, min(lo, size)), max(0, min(hi, size))
            piece = _narrow(src, d, lo, hi, memo, is_slice=True)
    memo[node] = piece
    return piece


def _narrow(src: Node, dim: int, start: int, end: int, memo, *, is_slice=False):
    """``src[start:end]`` along ``dim``, expressed on the root of ``src``."""
    parent = piece_of(src, memo) if isinstance(src, Node) else None
    if parent is not None and parent.dim == dim:
        return Piece(parent.root, dim, parent.start + start, parent.start + end, derived=True)
    if _static_dim_size(src, dim) is None:
        return None
    return Piece(src, dim, start, end, derived=is_slice)


def _mutable(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def merge_duplicate_splits(graph: torch.fx.Graph) -> int:
    """Step 2: later splits of a tensor with the same sizes and dim use the first one's
    pieces. Returns the pieces redirected."""
    first: dict = {}
    redirected = 0
    for node in list(graph.nodes):
        cut = _split_sizes(node)
        if cut is None or node.target is not aten.split_with_sizes.default:
            continue
        if not all(u.target is operator.getitem for u in node.users):
            continue
        key = (node.args[0], tuple(cut[0]), cut[1])
        canonical = first.setdefault(key, node)
        if canonical is node:
            continue
        for user in list(node.users):
            user.replace_all_uses_with(_getitem(graph, canonical, user.args[1]))
            graph.erase_node(user)
            redirected += 1
        graph.erase_node(node)
    return redirected


def _getitem(graph: torch.fx.Graph, split: Node, index: int) -> Node:
    for user in split.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(split):
        item = graph.call_function(operator.getitem, (split, index))
    item.meta["val"] = _val(split)[index]
    return item


def finest_chain(intervals, size: int) -> list[tuple[int, int]] | None:
    """The chain of ``intervals`` (``(start, end)`` pairs) that covers ``[0, size)`` exactly
    with the most pieces, or None."""
    ends = defaultdict(list)
    for lo, hi in intervals:
        if hi > lo:
            ends[lo].append(hi)
    best: dict[int, list | None] = {size: []}
    for pos in sorted(ends, reverse=True):
        options = [[(pos, hi)] + best[hi] for hi in ends[pos] if best.get(hi) is not None]
        best[pos] = max(options, key=len) if options else None
    return best.get(0)


def coalesce_pieces(graph: torch.fx.Graph) -> int:
    """Step 1 (module docstring): derived pieces that cover a dim exactly become one
    ``split_with_sizes``. Returns the nodes redirected."""
    memo: dict = {}
    groups: dict = defaultdict(lambda: defaultdict(list))
    for node in graph.nodes:
        piece = piece_of(node, memo)
        if piece is not None and piece.derived and piece.end > piece.start:
            groups[(piece.root, piece.dim)][(piece.start, piece.end)].append(node)
    redirected = 0
    for (root, dim), by_interval in groups.items():
        if any(_mutable(u) for u in root.users):
            continue
        chain = finest_chain(by_interval, _static_dim_size(root, dim))
        if chain is None or len(chain) < 2:
            continue
        sizes = [hi - lo for lo, hi in chain]
        with graph.inserting_after(root):
            split = graph.call_function(
                aten.split_with_sizes.default, (root, sizes, dim - _val(root).dim())
            )
        split.meta["val"] = aten.split_with_sizes.default(_val(root), sizes, dim)
        for index, interval in enumerate(chain):
            item = _getitem(graph, split, index)
            for node in by_interval[interval]:
                node.replace_all_uses_with(item)
                redirected += 1
    return redirected


def negative_split_dims(graph: torch.fx.Graph) -> None:
    """Write every split's dim counted from the end (``-1``: the last), as model code writes
    ``qkv.split([...], dim=-1)``, so that splits written either way look the same."""
    for node in graph.nodes:
        if node.target not in (aten.split_with_sizes.default, aten.split.Tensor):
            continue
        if len(node.args) > 2 and type(node.args[2]) is int and node.args[2] >= 0:
            val = _val(node.args[0])
            if isinstance(val, torch.Tensor):
                node.args = (*node.args[:2], node.args[2] - val.dim(), *node.args[3:])


def coalesce_splits(graph: torch.fx.Graph) -> int:
    """Both steps; returns how many nodes now use a coalesced split (0: graph unchanged).
    Every split's dim is then written counted from the end (:func:`negative_split_dims`)."""
    redirected = coalesce_pieces(graph)
    redirected += merge_duplicate_splits(graph)
    negative_split_dims(graph)
    if redirected:
        graph.eliminate_dead_code()
    return redirected
