"""Issue 18 on the GPU: ``numerics="unfused"`` against the models' own code on CUDA, the peer
layouts and forms through the compiled kernel, and what in place and no-RoPE cost. Run on the
device machine from the repository root:

    PYTHONPATH=. python3 scripts/gpu_peers_numerics.py

1. checks (any failure: exit 1 after the tables):
   a. transformers' ``Qwen3Attention`` / ``Gemma3Attention`` / ``Olmo2Attention`` (bf16, random
      weights, on CUDA) against fqr ``unfused`` (OLMo2: ``unfused-hf``) on ``triton``, and
      vLLM's native prologue (``fqr.unfused``: NeoX/GPT-J, rotary ratio 1, 0.5, 0.25,
      head_dim 64/128/256, the grid of vLLM's fused-op test) likewise: the share of
      bit-identical q/k elements (at least 99.9% on CUDA, whose rsqrt and division are not IEEE
      in torch or Triton, so the fp32 statistic can differ; 100% on CPU), the largest ULP
      distance (reported), and vLLM's own tolerance (atol = rtol = 1e-2) on every case;
   b. every golden case (``fqr verify --backend triton``'s work) and the peer cases of
      ``tests/support/peer_cases.py`` (no RoPE, v heads/dim, padded heads, in place, q alone)
      on ``triton`` against float64;
   c. in place at Qwen3-8B shapes, T = 65,536: the same bits as out of place, v and every byte
      outside q/k unchanged.
2. timings (``triton.testing.do_bench``, median µs): Qwen3-8B bf16 out of place, in place and
   without RoPE, T = 1, 512, 16,384, 65,536.

Logs and ``gpu_peers_numerics.json`` go under ``$OUT`` (default: a temp dir). Without CUDA the
checks of 1a and 1b run on the ``reference`` backend with the CPU models and the timings are
skipped (said so).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.vllm_native import vllm_native_case  # noqa: E402

import fqr  # noqa: E402
from fqr.golden import list_cases, load_case  # noqa: E402
from fqr.numerics import ordered_bits  # noqa: E402
from fqr.presets import get_preset  # noqa: E402
from fqr.rope_cache import rope_cos_sin_cache  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "triton" if CUDA else "reference"
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-peers-"))
FAILURES: list[str] = []
# On CUDA, rsqrt and division are approximate in both torch and Triton: where the fp32 statistic
# differs, an element on a rounding boundary of x * rstd rounds the other way (and RoPE's
# cancellation can turn that ULP into several of the output). Those must stay rare.
MIN_SHARE = 0.999 if CUDA else 1.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    with open(OUT / "gpu_peers_numerics.log", "a") as f:
        f.write(msg + "\n")


def text_table(title: str, header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join(
        [title, line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    )


def bit_stats(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    got, want = got.detach().cpu(), want.detach().cpu()
    ulp = (ordered_bits(got) - ordered_bits(want)).abs()
    return float((ulp == 0).double().mean()), int(ulp.max()) if ulp.numel() else 0


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        FAILURES.append(f"{name}: {detail}")
        log(f"FAIL {name}: {detail}")


# ------------------------------------------------------------------------------ 1a: numerics


def models_rows(gen: torch.Generator) -> list[list]:
    from support.hf_models import hf_attention_case

    rows = []
    for family in ("qwen3", "gemma3", "olmo2"):
        for tokens in (1, 7, 512):
            args, kwargs, hf_q, hf_k = hf_attention_case(
                family, gen, tokens, DEVICE, heads=16, kv_heads=8, d=128
            )
            for numerics in (kwargs["numerics"], "fused"):  # olmo2: unfused-hf
                q, k, _ = fqr.split_qkv_rmsnorm_rope(
                    *args, **dict(kwargs, numerics=numerics), backend=BACKEND
                )
                (sq, uq), (sk, uk) = bit_stats(q, hf_q), bit_stats(k, hf_k)
                rows.append([f"HF {family}", tokens, numerics, f"{sq:.5f}", uq, f"{sk:.5f}", uk])
                if numerics != "fused":
                    check(f"HF {family} T={tokens}", min(sq, sk) >= MIN_SHARE, f"bits {sq}, {sk}")
    return rows


def vllm_rows(gen: torch.Generator) -> list[list]:
    rows = []
    for d in (64, 128, 256):
        for ratio in (1.0, 0.5, 0.25):
            for is_neox in (True, False):
                r = int(d * ratio)
                native = vllm_native_case(
                    gen,
                    torch.bfloat16,
                    d,
                    r,
                    is_neox=is_neox,
                    table_in_dtype=True,
                    heads=8,
                    kv_heads=2,
                    tokens=257,
                    max_position=8192,
                    device=DEVICE,
                )
                want_q, want_k = native.vllm()
                q, k, _ = fqr.split_qkv_rmsnorm_rope(
                    *native.args, **native.fqr_kwargs(backend=BACKEND)
                )
                (sq, uq), (sk, uk) = bit_stats(q, want_q), bit_stats(k, want_k)
                tol_ok = all(
                    torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
                    for a, b in ((q, want_q), (k, want_k))
                )
                style = "neox" if is_neox else "gptj"
                rows.append([f"vLLM d={d} r={r} {style}", f"{sq:.5f}", uq, f"{sk:.5f}", uk, tol_ok])
                check(
                    f"vLLM d={d} r={r} {style}",
                    min(sq, sk) >= MIN_SHARE and tol_ok,
                    f"bits {sq}, {sk}, vLLM tolerance {tol_ok}",
                )
    return rows


# ------------------------------------------------------------------ 1b, 1c: goldens and peers


def goldens_and_peers(gen: torch.Generator) -> list[list]:
    from support.peer_cases import PEER_CASES

    rows = []
    passed = 0
    cases = list_cases()
    for entry in cases:
        case = load_case(entry)
        q, k, v = case.to(DEVICE).run(BACKEND)
        checks = case.check(q, k, v)
        ok = all(c.passed for c in checks.values())
        passed += ok
        check(f"golden {case.name}", ok, str({n: c.to_dict() for n, c in checks.items()}))
    rows.append(["goldens", f"{passed}/{len(cases)} pass"])
    peers_ok = 0
    for case in PEER_CASES:
        try:
            check_peer_case_on_device(case, gen)
            peers_ok += 1
        except AssertionError as e:
            check(f"peer {case.name}", False, str(e))
    rows.append(["peer cases", f"{peers_ok}/{len(PEER_CASES)} pass"])
    rows.append(["q alone", q_alone(gen)])
    return rows


def q_alone(gen) -> str:
    """fqr.qk_rmsnorm_rope(q, None, ...) on DEVICE against float64 (Gemma-style weight)."""
    from fqr import reference
    from fqr.numerics import compare

    t, heads, d = 257, 8, 256
    q = (torch.randn(t, heads * d, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    table = rope_cos_sin_cache(d // 4, 4096, 1e6)
    w = (0.2 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    out, none = fqr.qk_rmsnorm_rope(
        q.to(DEVICE),
        None,
        pos.to(DEVICE),
        table.to(DEVICE),
        w.to(DEVICE),
        None,
        head_dim=d,
        weight_offset=1.0,
        backend=BACKEND,
    )
    exact, _ = reference.qk_prologue(q, None, pos, table, w, None, head_dim=d, weight_offset=1.0)
    c = compare(out.cpu(), exact, head_dim=d)
    check("q alone", c.passed and none is None, str(c))
    return "pass" if c.passed and none is None else "FAIL"


def check_peer_case_on_device(case, gen) -> None:
    """support.peer_cases.check_peer_case with the inputs on DEVICE (the same checks)."""
    from support import peer_cases as P

    from fqr import reference
    from fqr.numerics import compare

    buffer, qkv, positions, table, qw, kw = P.peer_inputs(case, gen)
    dev_buffer = buffer.to(DEVICE, copy=True)
    dev_qkv = dev_buffer[:, : qkv.shape[1]]
    kwargs = dict(num_heads=P.HQ, num_kv_heads=P.HKV, head_dim=P.D, **case.kwargs)
    feature = {k: v for k, v in kwargs.items() if k != "inplace"}
    exact = reference.prologue(qkv.clone(), positions, table, qw, kw, **feature)
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        dev_qkv,
        None if table is None else positions.to(DEVICE),
        None if table is None else table.to(DEVICE),
        qw.to(DEVICE),
        kw.to(DEVICE),
        numerics=case.numerics,
        backend=BACKEND,
        **kwargs,
    )
    for name, got, want in (("q", q, exact[0]), ("k", k, exact[1])):
        c = compare(got.cpu(), want, head_dim=P.D, numerics=case.numerics)
        assert c.passed, f"{case.name} {name}: {c}"
    assert torch.equal(v.cpu().view(torch.int16), exact[2].view(torch.int16)), f"{case.name}: v"
    w = (P.HQ + P.HKV) * P.D if kwargs.get("inplace") else 0
    after, before = dev_buffer.cpu().view(torch.int16), buffer.view(torch.int16)
    assert torch.equal(after[:, w:], before[:, w:]), f"{case.name}: bytes outside q/k moved"


def inplace_at_scale(gen: torch.Generator) -> list[list]:
    p = get_preset("qwen3-8b")
    t = 65536 if CUDA else 64
    spec = p.spec
    qkv = (torch.randn(t, spec.qkv_width, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    pos = torch.randint(0, p.max_position, (t,), generator=gen).to(DEVICE)
    table = p.cos_sin_cache().to(DEVICE)
    w = (1 + 0.2 * torch.randn(spec.head_dim, generator=gen)).to(DEVICE, torch.bfloat16)
    kw = spec.kwargs(backend=BACKEND)
    q, k, v = fqr.split_qkv_rmsnorm_rope(qkv, pos, table, w, w, **kw)
    before = qkv.clone()
    qi, ki, vi = fqr.split_qkv_rmsnorm_rope(qkv, pos, table, w, w, **kw, inplace=True)
    same = torch.equal(qi.view(torch.int16), q.view(torch.int16)) and torch.equal(
        ki.view(torch.int16), k.view(torch.int16)
    )
    untouched = torch.equal(
        qkv[:, spec.q_size + spec.kv_size :].view(torch.int16),
        before[:, spec.q_size + spec.kv_size :].view(torch.int16),
    )
    check("in place at scale", same and untouched, f"same bits {same}, v untouched {untouched}")
    return [[f"in place T={t}", f"same bits as out of place: {same}", f"v untouched: {untouched}"]]


# ----------------------------------------------------------------------------------- timings


def timings(gen: torch.Generator) -> list[list]:
    import triton.testing

    p = get_preset("qwen3-8b")
    spec = p.spec
    table = p.cos_sin_cache().cuda()
    w = (1 + 0.2 * torch.randn(spec.head_dim, generator=gen)).to("cuda", torch.bfloat16)
    kw = spec.kwargs(backend="triton")
    rows = []
    for t in (1, 512, 16384, 65536):
        qkv = (torch.randn(t, spec.qkv_width, generator=gen) * 2).to("cuda", torch.bfloat16)
        pos = torch.randint(0, p.max_position, (t,), generator=gen).cuda()
        spare = qkv.clone()

        def bench(pos_arg, table_arg, qkv=spare, **extra) -> float:
            call = lambda: fqr.split_qkv_rmsnorm_rope(  # noqa: E731
                qkv, pos_arg, table_arg, w, w, **kw, **extra
            )
            return triton.testing.do_bench(call, return_mode="median") * 1e3

        out_of_place = bench(pos, table)
        in_place = bench(pos, table, inplace=True)
        nope = bench(None, None)
        rows.append([t, f"{out_of_place:.1f}", f"{in_place:.1f}", f"{nope:.1f}"])
    return rows


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(18)
    log(f"device {DEVICE}, backend {BACKEND}, torch {torch.__version__}, out {OUT}")
    tables, doc = [], {}
    for title, header, fn in (
        (
            "1a. unfused vs transformers (share of bit-identical elements, max ULP)",
            ["model", "T", "numerics", "q bits", "q ULP", "k bits", "k ULP"],
            models_rows,
        ),
        (
            "1a. unfused vs vLLM native (bf16, T=257)",
            ["case", "q bits", "q ULP", "k bits", "k ULP", "vLLM tol"],
            vllm_rows,
        ),
        ("1b. goldens and peer cases", ["what", "result"], goldens_and_peers),
        ("1c. in place at scale", ["what", "result", ""], inplace_at_scale),
    ):
        try:
            rows = fn(gen)
        except Exception:
            FAILURES.append(f"{title}: {traceback.format_exc()}")
            log(traceback.format_exc())
            continue
        doc[title] = rows
        tables.append(text_table(title, header, rows))
    if CUDA:
        rows = timings(gen)
        doc["timings"] = rows
        tables.append(
            text_table(
                "2. Qwen3-8B bf16, median µs (do_bench)",
                ["T", "out of place", "in place", "no RoPE"],
                rows,
            )
        )
    else:
        tables.append("2. timings skipped: no CUDA")
    doc["failures"] = FAILURES
    (OUT / "gpu_peers_numerics.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n\n".join(tables))
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f[:300]}" for f in FAILURES))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
