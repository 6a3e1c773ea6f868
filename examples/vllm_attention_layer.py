"""vLLM drop-in: an attention layer that calls fqr's op, and fqr's Inductor pass in a vLLM-style
post-grad pass manager. Runs on CPU without vLLM installed.

1. **A custom attention layer** (vLLM's ``Qwen3Attention`` with the prologue as one call).
   vLLM's own fused kernels write into buffers they are given (``fused_qk_norm_rope`` and
   ``rotary_embedding`` write q and k back into ``qkv``); fqr offers both forms:

   * ``inplace=True``: q and k are written back into ``qkv`` where they were read, v stays
     there; returns views of ``qkv`` (vLLM's in-place op);
   * ``out=(q, k, v)``: written into caller buffers, here slices of one persistent
     ``[max_num_batched_tokens, q | k | v]`` buffer of the layer, as a CUDA-graph runner keeps
     static outputs. Each buffer is checked (shape, dtype, device, strides, no overlap) and a
     bad one is an error that names it.

   The layer's q, k are checked against fqr's float64 reference (``fqr.reference``) under the
   numerics contract, v bit for bit, and each form is checked to have written where it says.

2. **The pass in vLLM's pass manager.** vLLM compiles a model with Inductor and puts its
   ``PostGradPassManager`` (``vllm/compilation/pass_manager.py``) in Inductor's
   ``post_grad_custom_post_pass`` hook; a pass given in
   ``CompilationConfig.inductor_compile_config["post_grad_custom_post_pass"]`` is added to
   that manager's list (``VllmBackend.configure_post_pass``, which wants a vLLM
   ``InductorPass``: a ``CustomGraphPass`` with ``uuid()`` and ``is_applicable(shape)``).
   With vLLM installed::

       from vllm import LLM
       from vllm.compilation.inductor_pass import InductorPass
       from fqr.fusion import FusionPass

       class FqrPrologueFusion(InductorPass):
           def __init__(self):
               self.fusion = FusionPass()

           def __call__(self, graph):
               self.fusion(graph)

           def uuid(self):
               return self.fusion.uuid()

       # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the pass object is not pickled
       llm = LLM("Qwen/Qwen3-8B", compilation_config={
           "inductor_compile_config": {"post_grad_custom_post_pass": FqrPrologueFusion()}})

   Here :class:`PassManager` stands in for vLLM's manager (passes run in order on the
   post-grad graph; its uuid, which keys Inductor's cache, hashes theirs), installed in the
   same hook around ``torch.compile`` of a vLLM-style model (``fqr.fusion.models``: vLLM's
   ``Qwen3Attention`` prologue op for op). The script prints the sites fused and the compiled
   output against eager.

Exit 0 when every check passed, 1 otherwise::

    python examples/vllm_attention_layer.py [--device cuda] [--dtype bf16] [--tokens 16]
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import fqr
from fqr import reference
from fqr.numerics import compare

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A Qwen3-shaped preset at test size: GQA 2:1, per-head QK norm, NeoX RoPE, theta 1e6.
TINY = fqr.Preset("tiny-qwen3", "", 4, 2, 16, 1e6, 512)


class FusedQwen3Attention(nn.Module):
    """vLLM's ``Qwen3Attention.forward`` with the prologue (split, q/k RMSNorm, RoPE) as one
    :func:`fqr.split_qkv_rmsnorm_rope` call; ``mode`` ``"out"`` or ``"inplace"``."""

    def __init__(self, preset, max_num_batched_tokens: int, dtype, device, mode: str = "out"):
        super().__init__()
        spec = self.spec = preset.spec
        self.mode = mode
        hidden = spec.q_size
        self.qkv_proj = nn.Linear(hidden, spec.qkv_width, bias=False, dtype=dtype, device=device)
        self.o_proj = nn.Linear(spec.q_size, hidden, bias=False, dtype=dtype, device=device)
        self.q_weight = nn.Parameter(1 + 0.2 * torch.randn(spec.head_dim, device=device).to(dtype))
        self.k_weight = nn.Parameter(1 + 0.2 * torch.randn(spec.head_dim, device=device).to(dtype))
        self.register_buffer("cos_sin_cache", preset.cos_sin_cache().to(device), persistent=False)
        # the layer's static output buffer: [max tokens, q | k | v]
        self.register_buffer(
            "qkv_out",
            torch.empty(max_num_batched_tokens, spec.qkv_width, dtype=dtype, device=device),
            persistent=False,
        )

    def prologue(self, positions, qkv):
        s, t = self.spec, qkv.shape[0]
        args = (qkv, positions, self.cos_sin_cache, self.q_weight, self.k_weight)
        if self.mode == "inplace":
            return fqr.split_qkv_rmsnorm_rope(*args, **s.kwargs(), inplace=True)
        buf = self.qkv_out[:t]
        views = (buf[:, : s.q_size], buf[:, s.q_size : s.q_size + s.kv_size], buf[:, -s.kv_size :])
        return fqr.split_qkv_rmsnorm_rope(*args, **s.kwargs(), out=views)

    def forward(self, positions, hidden):
        s, t = self.spec, hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = self.prologue(positions, qkv)
        q4, k4, v4 = (
            x.view(1, t, -1, s.head_dim).transpose(1, 2) for x in (q, k, v)
        )  # [1, H, T, D] views, no copy
        attn = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        return self.o_proj(attn.transpose(1, 2).reshape(t, s.q_size)), (qkv, q, k, v)


def check_layer(mode: str, tokens: int, dtype, device) -> bool:
    """Run the layer; its q, k against float64, v bit for bit, and where each form wrote."""
    torch.manual_seed(0)
    layer = FusedQwen3Attention(TINY, 64, dtype, device, mode=mode)
    layer.qkv_out.fill_(float("nan"))  # poison: an element left unwritten shows
    positions = torch.randint(0, TINY.max_position, (tokens,), device=device)
    hidden = torch.randn(tokens, TINY.spec.q_size, device=device).to(dtype)
    with torch.no_grad():
        qkv_in = layer.qkv_proj(hidden)
        out, (qkv, q, k, v) = layer(positions, hidden)
    s = TINY.spec
    exact = reference.prologue(
        qkv_in.cpu(), positions.cpu(), layer.cos_sin_cache.cpu(), layer.q_weight.detach().cpu(),
        layer.k_weight.detach().cpu(), **s.kwargs(),
    )  # fmt: skip
    checks = [compare(got.cpu(), want, head_dim=s.head_dim) for got, want in zip((q, k), exact)]
    v_exact = torch.equal(v.cpu(), exact[2].to(dtype))
    if mode == "inplace":
        where = q.data_ptr() == qkv.data_ptr() and layer.qkv_out.isnan().all().item()
    else:
        buf = layer.qkv_out
        where = q.data_ptr() == buf.data_ptr() and not buf[:tokens].isnan().any().item()
        where = where and buf[tokens:].isnan().all().item()
    ok = all(c.passed for c in checks) and v_exact and where and torch.isfinite(out).all().item()
    worst = max(c.error_ratio for c in checks)
    yes = {True: "yes", False: "NO"}
    print(
        f"layer ({mode:7}): q/k within the contract: {yes[all(c.passed for c in checks)]}"
        f" (worst err/tol {worst:.2g}), v exact: {yes[v_exact]}, written where asked: "
        f"{yes[bool(where)]}"
    )
    return bool(ok)


class PassManager(CustomGraphPass):
    """A post-grad pass manager as vLLM's ``PostGradPassManager``: its passes run in order on
    the post-grad graph; its uuid (part of Inductor's cache key) hashes theirs."""

    def __init__(self):
        self.passes: list[CustomGraphPass] = []

    def add(self, pass_: CustomGraphPass) -> None:
        self.passes.append(pass_)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for pass_ in self.passes:
            pass_(graph)

    def uuid(self) -> str:
        return hashlib.sha256(repr([p.uuid() for p in self.passes]).encode()).hexdigest()


def check_pass_manager(tokens: int, dtype, device, layers: int = 1) -> bool:
    """Compile a vLLM-style model with fqr's pass in the manager; sites fused, output vs eager."""
    from fqr.fusion import FusionPass
    from fqr.fusion.models import preset_model

    model = preset_model(TINY, layers, dtype, device=device)
    fusion = FusionPass()
    manager = PassManager()
    manager.add(fusion)
    positions = torch.randint(0, TINY.max_position, (tokens,), device=device)
    hidden = torch.randn(tokens, TINY.spec.q_size, device=device).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    # Inductor's caches off: a graph loaded from a cache skips the passes (nothing to count)
    with (
        torch._inductor.config.patch(post_grad_custom_post_pass=manager, fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch.no_grad(),
    ):
        got, _ = compiled(positions, hidden)
        want, _ = model(positions, hidden)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-6
    ok = fusion.stats.sites == layers and err <= tolerance
    print(
        f"pass manager: fused {fusion.stats.sites}/{layers} prologues; compiled vs eager: "
        f"max err {err:.2g} x max |out| (tolerance {tolerance:.2g}) -> {'ok' if ok else 'FAILED'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--tokens", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip the pass manager part")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    ok = all([check_layer(m, args.tokens, dtype, args.device) for m in ("out", "inplace")])
    if not args.no_compile:
        ok = check_pass_manager(args.tokens, dtype, args.device) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
