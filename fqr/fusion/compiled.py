"""Whole models compiled with and without the fusion pass, side by side, in one process.

:func:`compare_compiled` builds one of two random-weight models at real layer shapes and
compiles it twice with the same Inductor settings, once plain and once with
``fqr.fusion.backend()``:

* ``hf-qwen3``: Hugging Face transformers' ``Qwen3ForCausalLM`` (:mod:`fqr.fusion.hf_models`,
  separate q/k/v projections, ``Qwen3RMSNorm`` per head, ``rotate_half`` RoPE, MLPs, final
  norm), run as a prefill: every token through the decoder, logits of the last token;
* ``vllm``: the vLLM-shaped attention stack of :mod:`fqr.fusion.models` (vLLM's
  ``Qwen3Attention``: packed ``qkv_proj``, ``RotaryEmbedding``-style ``cos_sin_cache``).

On CUDA both compiled models run under CUDA graphs (Inductor's cudagraph trees, what
``mode="reduce-overhead"`` turns on: ``triton.cudagraphs``); the token count is dynamic
(``mark_dynamic``), so a new T records a new graph without recompiling (T = 1 compiles once
more: Dynamo specialises sizes 0 and 1).

What it reports (:class:`Comparison`):

* ``sites``: prologues fused (one per layer expected) and the unfused norm/RoPE ops left;
* numerics, judged against the *uncompiled* model on the same inputs. ``hf-qwen3``: the final
  hidden states and the last token's logits; the fused model's max error relative to the
  output's largest magnitude must be at most twice the plain compiled model's (the rounding
  differences compiling introduces anyway) plus 2^-8. ``vllm``: in addition, every layer's
  fused q and k against the float64 prologue of that layer's own qkv under the ``unfused``
  numerics contract (:mod:`fqr.numerics`), v bit-exact;
* latency: median ms per forward of both, the two sides interleaved in rounds at each T
  (:func:`_time_sides`), for prefill and decode-sized batches (T tokens in one forward, no KV
  cache: the prologue's cost per token, not attention over a cache); on CUDA both sides replay
  CUDA graphs, and ``cudagraph_skips`` counts the graphs Inductor would not capture (0 each);
* the profile split (CUDA): torch.profiler kernel time per forward at the given T, each
  kernel classified by what its name says it computes (:func:`classify_kernel`): the
  prologue is fqr's kernel and its Inductor glue, Inductor's RoPE kernels and the q/k norm
  reductions; the rest is everything else: GEMMs, attention and the causal mask, the
  model's other RMSNorms, the MLP (:func:`profile_split`). The SDPA backend each side ran
  is read from the same profile (:func:`attention_backend`); for the ``vllm`` model
  ``sdpa_choice`` also records the backend PyTorch picks for each T (a fused one on CUDA);
* :meth:`Comparison.targets`: issue 16's targets, met or not, with the numbers.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from ..core import dtype_name
from ..presets import DEFAULT_PRESET
from .fusion_pass import FusionBackend, fusion_patterns
from .hf_models import QWEN3_8B_PRESET
from .models import MODELS

PREFILL_TOKENS = (512, 2048, 4096, 16384)
DECODE_TOKENS = (1, 2, 4, 8, 16)
PROFILE_TOKENS = (4096, 16384)
LOGITS_FLOOR = 2.0**-8  # relative to the output's largest magnitude


class InductorBackend:
    """Plain Inductor with :class:`FusionBackend`'s cache and config settings, no pass."""

    def __init__(self, config_patches: dict | None = None):
        self.config_patches = dict(config_patches or {})

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        patches = {"fx_graph_cache": False, **self.config_patches}
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)


@dataclass
class LatencyRow:
    phase: str  # prefill | decode
    tokens: int
    unfused_ms: float
    fused_ms: float

    @property
    def speedup(self) -> float:
        return self.unfused_ms / self.fused_ms if self.fused_ms else float("nan")


@dataclass
class ProfileSplit:
    tokens: int
    unfused_prologue_us: float
    unfused_total_us: float
    fused_prologue_us: float
    fused_total_us: float
    unfused_prologue_kernels: dict = field(default_factory=dict)  # name -> us per forward
    fused_prologue_kernels: dict = field(default_factory=dict)
    attention: dict = field(default_factory=dict)  # side -> SDPA backend that ran
    kernels: dict = field(default_factory=dict)  # side -> name -> {us, launches, category}

    @property
    def unfused_share(self) -> float:
        return self.unfused_prologue_us / self.unfused_total_us if self.unfused_total_us else 0.0

    @property
    def fused_share(self) -> float:
        return self.fused_prologue_us / self.fused_total_us if self.fused_total_us else 0.0


@dataclass
class Comparison:
    model: str
    layers: int
    dtype: str
    device: str
    cudagraphs: bool
    sites: int  # fused prologues in the compiled graph with the fewest (each T=1 recompile too)
    graphs: int  # graphs compiled with the pass
    unfused_ops_left: dict  # the vllm model has no other norm: none may be left there
    numerics: dict  # output -> {fused_err, plain_err, limit, passed}; layer checks for vllm
    compile_s: dict  # side -> seconds of the first call (trace + compile + first run)
    cudagraph_skips: dict = field(default_factory=dict)  # side -> graphs run without CUDA graphs
    sdpa_choice: dict = field(default_factory=dict)  # vllm: T -> SDPA backend PyTorch picks
    latency: list[LatencyRow] = field(default_factory=list)
    profile: list[ProfileSplit] = field(default_factory=list)

    @property
    def numerics_passed(self) -> bool:
        return all(v["passed"] for v in self.numerics.values())

    @property
    def passed(self) -> bool:
        # HF's decoder keeps its input / post-attention / final RMSNorms: rsqrt and mean stay.
        leftovers_ok = self.model != "vllm" or not self.unfused_ops_left
        return self.sites == self.layers and leftovers_ok and self.numerics_passed

    def targets(self) -> list[dict]:
        """Issue 16's targets, each ``{target, passed, detail}`` (``passed`` None: not
        measured in this run, e.g. no profile on the CPU)."""
        out = []

        def add(target, passed, detail):
            out.append({"target": target, "passed": passed, "detail": detail})

        add(
            "every prologue fused",
            self.sites == self.layers,
            f"{self.sites} / {self.layers} per graph ({self.graphs} graph(s))",
        )
        worst = [
            f"{k}: {v['fused_err']:.3g} <= {v['limit']:.3g}"
            if "fused_err" in v
            else f"{k}: {v['max_rel_head']:.3g} ({v['tolerance']})"
            for k, v in self.numerics.items()
            if v["passed"]
        ]
        failed = [k for k, v in self.numerics.items() if not v["passed"]]
        add(
            "outputs within the unfused contract",
            not failed,
            ("FAILED: " + ", ".join(failed)) if failed else "; ".join(worst),
        )
        if self.latency:
            slowest = min(self.latency, key=lambda r: r.speedup)
            add(
                "latency with <= without at every T",
                all(r.fused_ms <= r.unfused_ms for r in self.latency),
                f"lowest without/with {slowest.speedup:.3f}x at {slowest.phase} T={slowest.tokens}"
                f" ({slowest.unfused_ms:.3f} vs {slowest.fused_ms:.3f} ms); "
                + ", ".join(f"{r.phase} {r.tokens}: {r.speedup:.3f}x" for r in self.latency),
            )
        big = [p for p in self.profile if p.tokens >= 4096]
        add(
            "prologue share at T >= 4096 with <= half of without",
            all(p.fused_share <= p.unfused_share / 2 for p in big) if big else None,
            "; ".join(
                f"T={p.tokens}: {p.unfused_prologue_us:.0f} -> {p.fused_prologue_us:.0f} us, "
                f"{100 * p.unfused_share:.2f}% -> {100 * p.fused_share:.2f}%"
                for p in big
            )
            or "no profile at T >= 4096",
        )
        ran = {(p.attention.get("unfused"), p.attention.get("fused")) for p in self.profile}
        picks = sorted(set(self.sdpa_choice.values()))
        if self.profile or picks:
            notes = [f"T={p.tokens}: without {p.attention['unfused']}, with "
                     f"{p.attention['fused']}" for p in self.profile]  # fmt: skip
            if picks:
                notes.append(f"PyTorch picks {', '.join(picks)}")
            if not self.profile:
                notes.append("no profile: the kernels that ran are not checked")
            add(
                "same fused SDPA kernel on both sides, never math",
                all(u == f and u not in ("math", "none") for u, f in ran) and "math" not in picks,
                "; ".join(notes),
            )
        if self.cudagraphs:
            add(
                "both sides under CUDA graphs",
                not any(self.cudagraph_skips.values()),
                f"cudagraph skips {self.cudagraph_skips}",
            )
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["latency"] = [dict(asdict(r), speedup=r.speedup) for r in self.latency]
        d["profile"] = [
            dict(asdict(p), unfused_share=p.unfused_share, fused_share=p.fused_share)
            for p in self.profile
        ]
        return dict(
            d, passed=self.passed, numerics_passed=self.numerics_passed, targets=self.targets()
        )


# ----------------------------------------------------------------------------- the models


class _Workload:
    """A model, the inputs for T tokens, and which outputs to compare."""

    def __init__(self, kind, layers, dtype, device, seed: int, tiny: bool, preset: str):
        self.kind, self.device, self.dtype = kind, torch.device(device), dtype
        self.gen = torch.Generator().manual_seed(seed + 1)
        if kind == "hf-qwen3":
            from .hf_models import QWEN3_8B, QWEN3_TINY, LastTokenLogits, hf_qwen3_model

            self.shape = QWEN3_TINY if tiny else QWEN3_8B
            model = hf_qwen3_model(self.shape, layers, dtype, device=self.device, seed=seed)
            self.module = LastTokenLogits(model).eval()
            self.token_dims = (1, 1)
        elif kind == "vllm":
            from ..presets import PrologueSpec, get_preset
            from .models import AttentionShape, VllmStyleModel, preset_model

            if tiny:
                shape = AttentionShape(PrologueSpec(4, 2, 16, 16), max_position=512)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    model = VllmStyleModel(64, [shape] * layers, dtype)
                self.module = model.to(self.device).eval()
            else:
                p = get_preset(preset)
                self.module = preset_model(p, layers, dtype, seed=seed, device=self.device)
            self.token_dims = (0, 0)
        else:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, dev = self.gen, self.device
        if self.kind == "hf-qwen3":
            ids = torch.randint(0, self.shape.vocab, (1, tokens), generator=g)
            return ids.to(dev), torch.arange(tokens, device=dev)[None]
        first = self.module.layers[0]
        hidden = torch.randn(tokens, self.module.hidden_size, generator=g).to(self.dtype)
        positions = torch.randint(0, first.shape.max_position, (tokens,), generator=g)
        return positions.to(dev), hidden.to(dev)

    def mark_dynamic(self, args) -> None:
        for a, dim in zip(args, self.token_dims):
            torch._dynamo.mark_dynamic(a, dim)

    def outputs(self, out) -> dict[str, torch.Tensor]:
        """The compared outputs, cloned (cudagraph outputs are overwritten by the next run)."""
        if self.kind == "hf-qwen3":
            return {"hidden": out[0].clone(), "logits": out[1].clone()}
        return {"hidden": out[0].clone()}

    def layer_checks(self, args, out) -> dict:
        """vLLM model: each layer's fused q/k against float64 (``unfused`` contract)."""
        if self.kind != "vllm":
            return {}
        positions = args[0]
        checks = {}
        for i, (layer, (qkv, q, k, v)) in enumerate(zip(self.module.layers, out[1])):
            checks[f"layer{i} q/k vs float64"] = layer.check_prologue(positions, qkv, q, k, v)
        return checks


# ------------------------------------------------------------------------------ running


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(fn, args, cudagraphs: bool):
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    return fn(*args)


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _time_sides(
    compiled: dict, args, device, cudagraphs: bool, rounds: int = 9, round_s: float = 0.05
) -> tuple[dict, dict]:
    """Median ms per forward of each side, the sides interleaved: 3 warm-up calls each
    (cudagraph trees record on the second, a new T may recompile), then ``rounds`` rounds;
    in each, every side (order alternating between rounds) runs ``n`` back-to-back calls
    (``n`` fills about ``round_s``, 2..200) timed with CUDA events around the ``n`` calls (the
    GPU timeline from the first launch to the last kernel's end: where replays are shorter
    than their CPU-side launch, as in decode, the CPU time counts too; wall time on CPU),
    giving one ms-per-call sample. Also returns, per side, the
    cudagraph skips Inductor counted during the warm-up (0: the side runs under CUDA graphs)."""
    skips = {}
    for side, fn in compiled.items():
        before = _cudagraph_skips()
        for _ in range(3):
            _call(fn, args, cudagraphs)
        skips[side] = _cudagraph_skips() - before
    _sync(device)
    start = time.perf_counter()
    _call(compiled["unfused"], args, cudagraphs)
    _sync(device)
    one = max(time.perf_counter() - start, 1e-5)
    n = int(min(200, max(2, round_s / one)))
    samples: dict = {side: [] for side in compiled}
    sides = list(compiled)
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            fn = compiled[side]
            if device.type == "cuda":
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(n):
                    _call(fn, args, cudagraphs)
                end.record()
                end.synchronize()
                samples[side].append(begin.elapsed_time(end) / n)
            else:
                start = time.perf_counter()
                for _ in range(n):
                    _call(fn, args, cudagraphs)
                samples[side].append(1e3 * (time.perf_counter() - start) / n)
    return {side: statistics.median(v) for side, v in samples.items()}, skips


_INDEX_SUFFIX = re.compile(r"_\d+$")
_INDUCTOR_KERNEL = re.compile(r"^triton_[a-z]+_fused_(?P<ops>.*?)(?:_\d+)?$")

# What a kernel computes, read from its name. Inductor names a fused kernel
# ``triton_{poi,per,red}_fused_<ops>_<index>`` after the ATen ops of the nodes it holds
# (``descriptive_names="original_aten"``); library kernels keep their own names.
FQR_OPS = ("split_qkv_rmsnorm_rope", "qk_rmsnorm_rope")  # torch.ops.fqr.*: Inductor's glue
ATTENTION_OPS = ("scaled_dot_product", "attention", "softmax", "bitwise_and")  # + causal mask
ROPE_OPS = ("cos", "sin", "neg", "index_select")  # the angle table, rotate_half, cache rows
NORM_OPS = ("rsqrt", "mean", "pow", "rms_norm")
CATEGORIES = ("fqr", "rope", "norm", "attention", "library", "other")


def _has(ops: str, names: tuple[str, ...]) -> bool:
    padded = f"_{ops}_"
    return any(f"_{n}_" in padded for n in names)


def classify_kernel(name: str) -> str:
    """The category of a CUDA kernel by what its name says it computes:

    * ``fqr``: fqr's kernel (``fqr_<target>_<key>``), or an Inductor kernel holding the
      nodes around a ``torch.ops.fqr.*`` call (named after the fqr op);
    * ``attention``: SDPA (library kernels: flash, memory-efficient, cuDNN) and Inductor
      kernels that feed it or build its mask (``scaled_dot_product``, ``softmax``,
      ``bitwise_and``), even when a scrap of another op was inlined into them;
    * ``rope``: Inductor kernels with a RoPE op (``cos``/``sin`` of the angle table, ``neg``
      of ``rotate_half``, ``index_select`` of cache rows), norm ops or not;
    * ``norm``: Inductor kernels with RMSNorm ops and no RoPE op: a model RMSNorm or the
      reduction half of a q/k norm (:func:`profile_split` tells them apart);
    * ``library``: any other non-Inductor kernel (GEMMs, copies);
    * ``other``: any other Inductor kernel (MLP activations, residual adds, layout copies).
    """
    if name.startswith("fqr_"):
        return "fqr"
    m = _INDUCTOR_KERNEL.match(name)
    if m is None:
        low = name.lower()
        if any(w in low for w in ("flash", "fmha", "sdpa", "attention", "attn", "softmax")):
            return "attention"
        return "library"
    ops = m.group("ops")
    if _has(ops, FQR_OPS):
        return "fqr"
    if _has(ops, ATTENTION_OPS):
        return "attention"
    if _has(ops, ROPE_OPS):
        return "rope"
    if _has(ops, NORM_OPS):
        return "norm"
    return "other"


def attention_backend(kernels) -> str:
    """Which SDPA backend ran, from the names of the kernels of one forward: ``cudnn``,
    ``efficient``, ``flash``, or ``math`` (no SDPA library kernel: Inductor decomposed
    attention into GEMMs and a softmax), ``none`` (no attention kernel at all)."""
    library = [n.lower() for n in kernels if classify_kernel(n) == "attention"]
    library = [n for n in library if not n.startswith("triton_")]
    for backend, words in (("cudnn", ("cudnn",)), ("efficient", ("fmha", "mem_eff", "cutlassf"))):
        if any(w in n for n in library for w in words):
            return backend
    if any("flash" in n for n in library):
        return "flash"
    if any(classify_kernel(n) == "attention" for n in kernels):
        return "math"
    return "none"


def kernel_times(fn, args, cudagraphs: bool, calls: int = 3) -> tuple[Counter, Counter]:
    """CUDA kernel time (µs, device time) and launches per forward by kernel name, from
    torch.profiler over ``calls`` forwards after 2 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        _call(fn, args, cudagraphs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _call(fn, args, cudagraphs)
        torch.cuda.synchronize()
    per_name: Counter = Counter()
    counts: Counter = Counter()
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            us = evt.device_time_total or evt.time_range.elapsed_us()
            per_name[evt.name] += us / calls
            counts[evt.name] += 1
    return per_name, Counter({k: v / calls for k, v in counts.items()})


def profile_split(tokens: int, unfused: tuple, fused: tuple) -> ProfileSplit:
    """Prologue vs rest of two profiles (``(µs, launches)`` per kernel name, per forward), by
    what each kernel computes (:func:`classify_kernel`), not by which kernels differ:

    * prologue: ``fqr`` and ``rope`` kernels, and the launches of a ``norm`` kernel (name
      compared without Inductor's index suffix) in excess of the other model's launches of
      it: a q/k norm reduction Inductor split from its RoPE. Launches both models make are
      the model's own RMSNorms (Hugging Face's input / post-attention / final norms), which
      the pass leaves alone;
    * rest: everything else (GEMMs, attention and its mask, MLP, residual adds, copies).
    """

    def by_stem(times, counts):
        t, c = Counter(), Counter()
        for name, us in times.items():
            stem = _INDEX_SUFFIX.sub("", name)
            t[stem] += us
            c[stem] += counts[name]
        return t, c

    (ut, uc), (ft, fc) = by_stem(*unfused), by_stem(*fused)

    def prologue(times, counts, other_counts) -> dict:
        out = {}
        for stem, us in times.items():
            kind = classify_kernel(stem)
            if kind in ("fqr", "rope"):
                out[stem] = us
            elif kind == "norm" and counts[stem] > other_counts[stem]:
                out[stem] = us * (counts[stem] - other_counts[stem]) / counts[stem]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def table(times, counts) -> dict:
        return {
            stem: {"us": us, "launches": counts[stem], "category": classify_kernel(stem)}
            for stem, us in sorted(times.items(), key=lambda kv: -kv[1])
        }

    u_pro, f_pro = prologue(ut, uc, fc), prologue(ft, fc, uc)
    return ProfileSplit(
        tokens,
        sum(u_pro.values()),
        sum(ut.values()),
        sum(f_pro.values()),
        sum(ft.values()),
        u_pro,
        f_pro,
        attention={"unfused": attention_backend(ut), "fused": attention_backend(ft)},
        kernels={"unfused": table(ut, uc), "fused": table(ft, fc)},
    )


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    scale = float(ref.double().abs().max())
    err = float((a.double() - ref.double()).abs().max())
    return err, scale


def compare_compiled(
    model: str = "hf-qwen3",
    *,
    layers: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    prefill: tuple[int, ...] = PREFILL_TOKENS,
    decode: tuple[int, ...] = DECODE_TOKENS,
    profile_tokens: tuple[int, ...] = PROFILE_TOKENS,
    check_tokens: int = 512,
    cudagraphs: bool | None = None,
    tiny: bool = False,
    preset: str = DEFAULT_PRESET,
    seed: int = 0,
    log=lambda msg: None,
) -> Comparison:
    """Compile ``model`` with and without the pass and compare them (module docstring).
    ``tiny``: test-size shapes (CPU tests); ``cudagraphs`` defaults to on for CUDA;
    ``preset``: the attention shapes of the ``vllm`` model (``hf-qwen3`` is Qwen3-8B's)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if model == "hf-qwen3" and preset != QWEN3_8B_PRESET:
        raise ValueError(f"hf-qwen3 is built at Qwen3-8B's layer shapes, not {preset!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if check_tokens < 2 or any(t < 1 for t in (*prefill, *decode, *profile_tokens)):
        raise ValueError("token counts must be >= 1 (check_tokens >= 2)")
    dev = torch.device(device)
    cudagraphs = dev.type == "cuda" if cudagraphs is None else cudagraphs
    if cudagraphs and dev.type != "cuda":
        raise ValueError("cudagraphs need a CUDA device")
    log("tracing the fusion patterns")
    fusion_patterns()
    work = _Workload(model, layers, dtype, dev, seed, tiny, preset)
    patches = {"triton.cudagraphs": True} if cudagraphs else {}
    fusion = FusionBackend(config_patches=patches)
    backends = {"unfused": InductorBackend(patches), "fused": fusion}
    compiled = {
        side: torch.compile(work.module, backend=b, dynamic=None) for side, b in backends.items()
    }

    check_args = work.inputs(check_tokens)
    work.mark_dynamic(check_args)
    compile_s, outs = {}, {}
    cudagraph_skips = {side: 0 for side in compiled}
    sdpa_choice = {}
    if model == "vllm":  # the backend SDPA picks for this device/dtype (traced the same way)
        for t in (1, check_tokens, *prefill, *decode):
            try:
                sdpa_choice[t] = work.module.layers[0].sdpa_backend(t)
            except Exception as e:  # a private torch API: record, the profile still tells
                sdpa_choice[t] = f"unknown ({type(e).__name__}: {e})"
    with torch.no_grad():
        eager_out = work.module(*check_args)
        eager = work.outputs(eager_out)
        for side, fn in compiled.items():
            log(f"compiling {model} {'with' if side == 'fused' else 'without'} the fusion pass")
            _sync(dev)
            start = time.perf_counter()
            before = _cudagraph_skips()
            out = _call(fn, check_args, cudagraphs)
            _sync(dev)
            compile_s[side] = time.perf_counter() - start
            cudagraph_skips[side] += _cudagraph_skips() - before
            outs[side] = work.outputs(out)
            if side == "fused":
                layer_checks = work.layer_checks(check_args, out)
            del out

        numerics: dict = {}
        for name, ref in eager.items():
            fused_err, scale = _rel_err(outs["fused"][name], ref)
            plain_err, _ = _rel_err(outs["unfused"][name], ref)
            limit = 2 * plain_err + LOGITS_FLOOR * scale
            numerics[f"{name} vs uncompiled"] = {
                "fused_err": fused_err,
                "plain_err": plain_err,
                "scale": scale,
                "limit": limit,
                "passed": fused_err <= limit,
            }
        numerics.update(layer_checks)

        rows = []
        for phase, sizes in (("prefill", prefill), ("decode", decode)):
            for t in sizes:
                log(f"timing {phase} T={t}")
                args = work.inputs(t)
                ms, skips = _time_sides(compiled, args, dev, cudagraphs)
                for side, n in skips.items():
                    cudagraph_skips[side] += n
                rows.append(LatencyRow(phase, t, ms["unfused"], ms["fused"]))

        splits = []
        if dev.type == "cuda":
            for t in profile_tokens:
                log(f"profiling T={t}")
                args = work.inputs(t)
                prof = {side: kernel_times(fn, args, cudagraphs) for side, fn in compiled.items()}
                splits.append(profile_split(t, prof["unfused"], prof["fused"]))
    torch._dynamo.reset()

    left: dict = {}
    for g in fusion.stats.graphs:
        for op, n in g.unfused_ops.items():
            left[op] = left.get(op, 0) + n
    return Comparison(
        model=model,
        layers=layers,
        dtype=dtype_name(dtype),
        device=str(dev),
        cudagraphs=cudagraphs,
        sites=min((g.sites for g in fusion.stats.graphs), default=0),
        graphs=len(fusion.stats.graphs),
        unfused_ops_left=left,
        numerics=numerics,
        compile_s=compile_s,
        cudagraph_skips=cudagraph_skips,
        sdpa_choice=dict(sorted(sdpa_choice.items())),
        latency=rows,
        profile=splits,
    )


# ------------------------------------------------------------------------------ tables


def comparison_tables(c: Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` for the summary, latency and profile tables of ``c`` (the
    CLI renders them with Rich)."""
    name = f"{c.model} ({c.layers} layers, {c.dtype}, {c.device}"
    name += ", CUDA graphs)" if c.cudagraphs else ")"
    summary = [
        ["prologues fused", f"{c.sites} / {c.layers} per graph ({c.graphs} graph(s))"],
        ["compile + first run", "  ".join(f"{k} {v:.1f} s" for k, v in c.compile_s.items())],
    ]
    for check, n in c.numerics.items():
        if "fused_err" in n:
            detail = (
                f"max err {n['fused_err']:.3g} (plain compile {n['plain_err']:.3g}, limit "
                f"{n['limit']:.3g}, max |x| {n['scale']:.3g})"
            )
        else:
            detail = f"max err {n['max_rel_head']:.3g} x head max ({n['tolerance']})"
            detail += "" if n["v_exact"] else ", v NOT bit-exact"
        summary.append([check, ("pass: " if n["passed"] else "FAIL: ") + detail])
    if c.cudagraphs:
        summary.append(
            ["cudagraph skips", ", ".join(f"{k} {v}" for k, v in c.cudagraph_skips.items())]
        )
    if c.sdpa_choice:
        picks = sorted(set(c.sdpa_choice.values()))
        summary.append(["SDPA backend PyTorch picks", ", ".join(picks)])
    for p in c.profile:
        summary.append(
            [
                f"SDPA backend that ran, T={p.tokens}",
                f"without {p.attention.get('unfused')}, with {p.attention.get('fused')}",
            ]
        )
    summary.append(["result", "ok" if c.passed else "FAILED"])
    latency = [
        [
            r.phase,
            str(r.tokens),
            f"{r.unfused_ms:.3f}",
            f"{r.fused_ms:.3f}",
            f"{r.speedup:.3f}x",
            "yes" if r.fused_ms <= r.unfused_ms else "NO",
        ]
        for r in c.latency
    ]
    profile = [
        [
            str(p.tokens),
            f"{p.unfused_prologue_us:.1f} / {p.unfused_total_us:.1f}",
            f"{100 * p.unfused_share:.2f}%",
            f"{p.fused_prologue_us:.1f} / {p.fused_total_us:.1f}",
            f"{100 * p.fused_share:.2f}%",
            "yes" if p.fused_share <= p.unfused_share / 2 else "NO",
        ]
        for p in c.profile
    ]
    tables = [
        (name, ["check", "value"], summary),
        (
            f"{c.model}: forward latency, ms (median of interleaved rounds, CUDA events)",
            ["phase", "T", "without", "with", "speedup", "with <= without"],
            latency,
        ),
    ]
    if profile:
        tables.append(
            (
                f"{c.model}: device time per forward, prologue kernels / all kernels, us",
                ["T", "without", "share", "with", "share", "share halved"],
                profile,
            )
        )
    tables.append(
        (
            f"{c.model}: targets (issue 16)",
            ["target", "result", "numbers"],
            [
                [
                    t["target"],
                    "n/a" if t["passed"] is None else "PASS" if t["passed"] else "FAIL",
                    t["detail"],
                ]
                for t in c.targets()
            ],
        )
    )
    return tables
