"""The reference backend's memory is bounded (issue 14, finding 12a): it evaluates the program
chunk by chunk over the tokens, so its peak is the outputs plus a bounded working set, not the
~8.5x the qkv bytes of one whole-batch evaluation. Measured as the process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``): what the OOM killer sees."""

from __future__ import annotations

import pytest
import torch
from support.contract import assert_contract
from support.memory import peak_bytes
from torch.utils._python_dispatch import TorchDispatchMode

import fqr
from fqr import backends
from fqr.presets import get_preset
from fqr.rope_cache import rope_cos_sin_cache


def _inputs(gen, tokens: int):
    p = get_preset("qwen3-0.6b")
    heads = p.num_heads + 2 * p.num_kv_heads
    scale = 0.5 + 2.5 * torch.rand(heads, 1, generator=gen)
    qkv = (torch.randn(tokens, heads, p.head_dim, generator=gen) * scale).reshape(tokens, -1)
    args = (
        qkv.to(torch.bfloat16),
        torch.randint(0, p.max_position, (tokens,), generator=gen),
        p.cos_sin_cache(),
        (1 + 0.2 * torch.randn(p.head_dim, generator=gen)).to(torch.bfloat16),
        (1 + 0.2 * torch.randn(p.head_dim, generator=gen)).to(torch.bfloat16),
    )
    kwargs = dict(
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        eps=p.eps,
        backend="reference",
    )
    return args, kwargs


def test_reference_peak_is_a_small_multiple_of_the_qkv_bytes(gen):
    args, kwargs = _inputs(gen, 4096)  # 32 MiB of bf16 qkv: a whole-batch pass peaks ~10x
    fqr.split_qkv_rmsnorm_rope(
        *(a[:8] if a.dim() and a.shape[0] == 4096 else a for a in args), **kwargs
    )  # warm: tracing, allocator
    outs = []
    peak = peak_bytes(lambda: outs.extend(fqr.split_qkv_rmsnorm_rope(*args, **kwargs)))
    qkv_bytes = args[0].numel() * args[0].element_size()
    assert peak <= 2 * qkv_bytes, f"peak {peak / qkv_bytes:.2f}x the qkv bytes"
    assert [o.shape[0] for o in outs] == [4096] * 3


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_chunks_change_nothing(gen, monkeypatch, numerics):
    """Chunked and whole-batch evaluation give the same bits (every row is independent),
    including a last chunk shorter than the others."""
    args, kwargs = _inputs(gen, 37)
    kwargs["numerics"] = numerics
    whole = fqr.split_qkv_rmsnorm_rope(*args, **kwargs)
    row = args[0].shape[1] + 1  # qkv and positions elements per token
    monkeypatch.setattr(backends, "REFERENCE_CHUNK_ELEMENTS", 5 * row)
    calls = []
    evaluate = backends.eval_program
    monkeypatch.setattr(
        backends,
        "eval_program",
        lambda prog, a, dt: calls.append(a[0].shape[0]) or evaluate(prog, a, dt),
    )
    chunked = fqr.split_qkv_rmsnorm_rope(*args, **kwargs)
    assert calls == [5] * 7 + [2]
    for w, c in zip(whole, chunked):
        assert torch.equal(w, c)
    assert_contract(chunked, args, kwargs, numerics)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor (in bytes) any aten op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_reference_gathers_table_rows_before_upcasting(gen, numerics):
    """A bf16 table of 262,144 x 128 (64 MiB; 128 MiB in fp32) and one-token calls: no op of a
    call may produce a tensor anywhere near the table's size (issue 18, item 4: the whole table
    was cast to fp32 per call). Every aten op's output is measured, so this cannot flake."""
    p = get_preset("qwen3-0.6b")
    d, rows = p.head_dim, 262_144
    table = rope_cos_sin_cache(d, rows, p.rope_theta).to(torch.bfloat16)
    qkv_width = (p.num_heads + 2 * p.num_kv_heads) * d
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    kwargs = dict(
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=d,
        numerics=numerics,
        backend="reference",
    )
    qkv = torch.randn(1, qkv_width, generator=gen).to(torch.bfloat16)
    fqr.split_qkv_rmsnorm_rope(qkv, torch.tensor([5]), table, w, w, **kwargs)  # warm: tracing
    watch = _LargestAllocation()
    with watch:
        for position in torch.randint(0, rows, (64,), generator=gen).tolist():
            qkv = torch.randn(1, qkv_width, generator=gen).to(torch.bfloat16)
            q, k, _ = fqr.split_qkv_rmsnorm_rope(
                qkv, torch.tensor([position]), table, w, w, **kwargs
            )
            assert torch.isfinite(q).all() and torch.isfinite(k).all()
    table_bytes = table.numel() * table.element_size()
    assert watch.largest < table_bytes // 1000, f"an op produced {watch.largest} bytes"


def test_eager_rope_gathers_table_rows_before_upcasting(gen):
    """The same for an op called eagerly (fqr.ops.rope on tensors)."""
    from fqr import ops

    table = rope_cos_sin_cache(64, 262_144, 1e6).to(torch.bfloat16)
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    watch = _LargestAllocation()
    with watch:
        y = ops.rope(x, torch.tensor([200_000]), table, head_dim=64)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert watch.largest < table.numel() * table.element_size() // 1000
