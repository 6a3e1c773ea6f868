"""MLA cache calls at any latent width, in every cache dtype (issue 41): fresh inputs for
``fqr.mla_cache_insert`` (vLLM's ``concat_and_cache_mla`` / ``concat_and_cache_ds_mla``, and
FlashInfer's two caches) and ``fqr.split_mla_rmsnorm_rope_cache`` at a given latent width,
rope width and page size, and the check of what a call stored against the float64
formulation (the declarations' references, :func:`fqr.reference.mla_cache_entry` /
:func:`fqr.reference.ds_mla_entry`): every written entry's latent and rope parts under the
numerics contract (FP8 caches read as the float8 values their bytes hold), every other entry
bit for bit. Shared by the CPU tests (``tests/backends/test_mla_latent_widths.py``) and the
GPU ones (``tests/gpu/test_gpu_mla_engines.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import fqr
from fqr.numerics import compare, compare_kind
from fqr.prologue.mla_kv import TILE
from fqr.rope_cache import rope_cos_sin_cache

E4M3, E5M2, BYTES = torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8
# vLLM's kv_cache_dtype names -> the float8 dtype a per-tensor FP8 cache holds
FP8_NAMES = {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
CACHE_DTYPES = ("auto", *FP8_NAMES, "fp8_ds_mla")
WIDTHS = (64, 96, 192, 512, 576)  # the latent widths (ds_mla: 512, whole tiles)
MAX_POSITION = 4096


def ds_mla_fits(width: int) -> bool:
    return width % TILE == 0


def _normal(gen, *shape):
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _cache(gen, name, blocks, block_size, width, rope, dtype, *, rope_dtype=None):
    """A cache of random entries (an entry written where no slot names it shows) as vLLM
    allocates it: the model dtype ('auto'), uint8 bytes of E4M3 / E5M2 values (a per-tensor
    FP8 name), or well-formed ``fp8_ds_mla`` entries (E4M3 values, positive float32 scales,
    16-bit rope values)."""
    if name == "fp8_ds_mla":
        values = (_normal(gen, blocks, block_size, width) * 50).to(E4M3).view(BYTES)
        scales = (_normal(gen, blocks, block_size, width // TILE).abs() + 0.01).float()
        rope_part = _normal(gen, blocks, block_size, rope).to(rope_dtype or dtype).view(BYTES)
        return torch.cat([values, scales.view(BYTES), rope_part], dim=-1).contiguous()
    entry = _normal(gen, blocks, block_size, width + rope) * 3
    typed = FP8_NAMES.get(name)
    return entry.to(dtype) if typed is None else entry.to(typed).view(BYTES)


def _latent(gen, tokens, width, dtype):
    """kv_c of tokens whose 128-wide stretches differ in magnitude (a tile's own scale
    shows), some values past what an FP8 store with the drawn scale keeps (the clamp)."""
    x = _normal(gen, tokens, width) * 2
    x[:, TILE : 2 * TILE] *= 40
    return x.to(dtype)


def _slots(gen, tokens, slots):
    mapping = torch.randperm(slots, generator=gen)[:tokens]
    if tokens > 1:
        mapping[1::3] = -1  # padding tokens: nothing stored
    return mapping


def _scale(gen, name):
    """vLLM's ``layer._k_scale``: a 0-dim float32 tensor; small for an FP8 cache (values past
    the format's range saturate), 1.0 where the dtype takes no scale (vLLM passes it anyway)."""
    if name in FP8_NAMES:
        top = 448.0 if FP8_NAMES[name] == E4M3 else 57344.0
        return torch.tensor(40.0 / top * (1 + float(torch.rand((), generator=gen))))
    return torch.tensor(1.0)


@dataclass
class MlaCall:
    """One public call (``op(**args)``) and what checks it: the cache names and widths."""

    op: object
    args: dict
    width: int
    rope: int
    kv_cache_dtype: str

    def expected(self) -> dict:
        """The float64 expectations by output name (the declaration's reference)."""
        decl = self.op.declaration  # type: ignore[attr-defined]
        outs = decl.reference(**decl.reference_kwargs(self.args))
        names = [o.name for o in decl.outputs if o.present is None or o.present(self._call())]
        return dict(zip(names, outs))

    def _call(self):
        decl = self.op.declaration  # type: ignore[attr-defined]
        return decl.bound(decl.bind((), self.args))

    def moved(self, device: str, backend: str) -> MlaCall:
        """The same call with every tensor on ``device`` (its float64 expectation stays the
        CPU call's), run by ``backend``."""
        args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.args.items()}
        return MlaCall(self.op, dict(args, backend=backend), self.width, self.rope,
                       self.kv_cache_dtype)  # fmt: skip

    def run(self, **change):
        """Run on copies of the caches: returns ``(result, {cache name: written copy})``."""
        args = dict(self.args, **change)
        for n in ("kv_cache", "kpe_cache"):
            if args.get(n) is not None:
                args[n] = args[n].clone()
        result = self.op(**args)  # type: ignore[operator]
        return result, {n: args[n] for n in ("kv_cache", "kpe_cache") if args.get(n) is not None}


def insert_call(
    gen, width, rope, block_size, name, *, dtype=torch.bfloat16, tokens=5, two_caches=False,
    backend="reference", short=True, scale="fp8",
) -> MlaCall:  # fmt: skip
    """``fqr.mla_cache_insert`` as vLLM's MLA backends call it: kv_c and k_pe views of one
    ``[T, width + rope]`` row, the cache as vLLM allocates it (uint8 for a per-tensor FP8
    name), slots one shorter than T (a CUDA-graph pad; every third a padding slot), a 0-dim
    ``scale`` for a per-tensor FP8 name (``scale="vllm"``: vLLM's ``scale=layer._k_scale``
    whatever the dtype; None: none); with ``two_caches`` FlashInfer's ``ckv_cache`` /
    ``kpe_cache``."""
    row = torch.cat([_latent(gen, tokens, width, dtype), _normal(gen, tokens, rope).to(dtype)], 1)
    blocks = max(1, -(-2 * tokens // block_size))
    cache = _cache(gen, name, blocks, block_size, width, rope, dtype)
    n = tokens - 1 if short and tokens > 1 else tokens
    args = dict(
        kv_c=row[:, :width],
        k_pe=row[:, width:],
        kv_cache=cache,
        slot_mapping=_slots(gen, n, blocks * block_size),
        kv_cache_dtype=name,
        scale=_scale(gen, name) if scale == "vllm" or (scale and name in FP8_NAMES) else None,
        backend=backend,
    )
    if two_caches:
        args["kv_cache"], args["kpe_cache"] = (
            cache[..., :width].contiguous(),
            cache[..., width:].contiguous(),
        )
    return MlaCall(fqr.mla_cache_insert, args, width, rope, name)


def prologue_call(
    gen, width, rope, block_size, name, *, dtype=torch.bfloat16, tokens=5, q_lora=24,
    two_caches=False, backend="reference",
) -> MlaCall:  # fmt: skip
    """``fqr.split_mla_rmsnorm_rope_cache`` whose cache is of vLLM's ``name`` (the op takes
    the cache's dtype: the model dtype, float8_e4m3fn, float8_e5m2, uint8 ``fp8_ds_mla``):
    the projection row ``[q_c | kv_c | k_pe]``, real positions and table, weights near 1."""
    kv_a = torch.cat(
        [
            _normal(gen, tokens, q_lora).to(dtype),
            _latent(gen, tokens, width, dtype),
            _normal(gen, tokens, rope).to(dtype),
        ],
        dim=1,
    )
    blocks = max(1, -(-2 * tokens // block_size))
    cache = _cache(gen, name, blocks, block_size, width, rope, dtype)
    typed = FP8_NAMES.get(name)
    if typed is not None:
        cache = cache.view(typed)  # this op takes the float8 tensor itself

    def weight(k):
        return (1 + 0.2 * _normal(gen, k)).to(dtype)

    args = dict(
        kv_a=kv_a,
        positions=torch.randint(0, MAX_POSITION, (tokens,), generator=gen),
        cos_sin_cache=rope_cos_sin_cache(rope, MAX_POSITION, 1e4),
        q_a_weight=weight(q_lora) if q_lora else None,
        kv_a_weight=weight(width),
        kv_cache=cache,
        slot_mapping=_slots(gen, tokens, blocks * block_size),
        q_lora_rank=q_lora,
        kv_lora_rank=width,
        qk_rope_head_dim=rope,
        k_scale=_scale(gen, name).reshape(1) if typed is not None else None,
        backend=backend,
    )
    if two_caches:
        args["kv_cache"], args["kpe_cache"] = (
            cache[..., :width].contiguous(),
            cache[..., width:].contiguous(),
        )
    return MlaCall(fqr.split_mla_rmsnorm_rope_cache, args, width, rope, name)


def _typed(x: torch.Tensor, name: str) -> torch.Tensor:
    typed = FP8_NAMES.get(name)
    return x.view(typed) if typed is not None and x.dtype == BYTES else x


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(BYTES)


def _written(call: MlaCall, cache: torch.Tensor) -> torch.Tensor:
    slots = call.args["slot_mapping"]
    slots = slots[slots >= 0].long()
    written = torch.zeros(cache.shape[0], cache.shape[1], dtype=torch.bool)
    written[slots // cache.shape[1], slots % cache.shape[1]] = True
    return written


def check_caches(call: MlaCall, caches: dict, before: dict | None = None) -> None:
    """What the call stored against float64: each written entry's latent part (head =
    the latent width) and rope part (head = the rope width) under the contract, every other
    entry's bytes as they were."""
    expected = call.expected()
    before = before or {n: call.args[n] for n in caches}
    if call.kv_cache_dtype == "fp8_ds_mla":
        c = compare_kind("fp8-ds-mla", caches["kv_cache"], expected["kv_cache"], head_dim=call.rope)
        assert c.passed, f"fp8_ds_mla width {call.width}: {c}"
        return
    parts = (
        {"kv_cache": ((0, call.width),), "kpe_cache": ((0, call.rope),)}
        if "kpe_cache" in caches
        else {"kv_cache": ((0, call.width), (call.width, call.width + call.rope))}
    )
    for n, out in caches.items():
        written = _written(call, out)
        got, want = _typed(out, call.kv_cache_dtype), expected[n]
        assert got.shape == want.shape, (n, got.shape, want.shape)
        for start, end in parts[n]:
            c = compare(
                got[written][:, start:end], want[written][:, start:end], head_dim=end - start
            )
            assert c.passed, f"{call.kv_cache_dtype} width {call.width} {n}[{start}:{end}]: {c}"
        assert torch.equal(_bits(out)[~written], _bits(before[n])[~written]), f"{n}: untouched"


def check_outputs(call: MlaCall, result) -> None:
    """The prologue's returned q_c, kv_c and k_pe against float64 under the contract."""
    expected = call.expected()
    q_c, kv_c, k_pe = result
    for n, out, head in (("q_c", q_c, None), ("kv_c", kv_c, call.width), ("k_pe", k_pe, call.rope)):
        if out is None:
            continue
        c = compare(out, expected[n], head_dim=head or out.shape[1])
        assert c.passed, f"{n}: {c}"
