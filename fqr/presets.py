"""Real model attention-prologue shapes, and their tensor-parallel views.

Each preset records what the fused op needs from a model's config: head counts, head_dim,
rotary_dim (partial rotary), RoPE style and table (theta, scaling), the QK-norm kind
("head": per-head RMSNorm as in Qwen3/Gemma 3; "full": one RMSNorm over the whole q and the
whole k projection as in OLMo2; "none": split + RoPE only, as in Llama 3 and GLM-4), its eps
and weight offset (1.0 for Gemma-style ``(1 + w)`` weights).

Multi-head Latent Attention presets (DeepSeek-V2/V3/V3.2, Kimi-K2; variant ``mla-kv``) take
the rotated part as the head: ``head_dim`` = rotary_dim = ``qk_rope_head_dim``, q heads =
``num_attention_heads``, one kv head (the latent and its k_pe, which every TP rank holds),
GPT-J pairs and DeepSeek's yarn table; the latent's sizes and the cache are variant params.

``preset.shard(tp)`` is what one tensor-parallel rank holds, as vLLM shards attention: q heads
are divided by ``tp``; kv heads are divided when ``num_kv_heads >= tp`` and replicated (one per
rank) otherwise, which needs ``tp % num_kv_heads == 0``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

from .core import lookup
from .rope_cache import (
    SCALING_REQUIRED,
    YARN_DEFAULTS,
    check_rope,
    fraction,
    positive_count,
    positive_number,
    rope_cos_sin_cache,
)
from .validate import (
    check_finite_scalar,
    check_mrope_section,
    check_positive_int,
    check_spec_params,
)


@dataclass(frozen=True)
class PrologueSpec:
    """The static parameters of one call of the prologue, and the sizes they imply.

    What :func:`fqr.split_qkv_rmsnorm_rope` takes besides tensors (:meth:`kwargs`), plus
    ``rotary_dim`` (the width of the ``cos_sin_cache`` the call reads). Every consumer (the
    bench and its peers, the runtime, the goldens, the fusion models, the CLI) takes this record
    instead of deriving sizes again; a :class:`Preset` gives its own (:attr:`Preset.spec`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    eps: float = 1e-6
    is_neox: bool = True
    weight_offset: float = 0.0
    norm: str = "head"

    def __post_init__(self):
        check_spec_params(**{f.name: getattr(self, f.name) for f in fields(self)})
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "weight_offset", float(self.weight_offset))

    @classmethod
    def of(cls, source) -> PrologueSpec:
        """The spec of anything that carries its fields, as attributes (a :class:`Preset`) or
        keys (a golden manifest entry)."""
        names = [f.name for f in fields(cls)]
        if isinstance(source, dict):
            return cls(**{name: source[name] for name in names})
        return cls(**{name: getattr(source, name) for name in names})

    @property
    def q_size(self) -> int:
        """Width of q: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of k (and of v): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """Width of the packed ``[q | k | v]`` row."""
        return self.q_size + 2 * self.kv_size

    @property
    def norm_widths(self) -> tuple[int, int] | None:
        """Lengths of the q and k norm weights (and biases): ``head_dim`` each for a per-head
        norm, the q and k widths for a full-width norm; None without a norm."""
        if self.norm == "none":
            return None
        if self.norm == "head":
            return self.head_dim, self.head_dim
        return self.q_size, self.kv_size

    def kwargs(self, **extra) -> dict:
        """Keyword arguments of :func:`fqr.split_qkv_rmsnorm_rope` (and of
        :func:`fqr.reference.prologue`), with ``extra`` (``numerics=``, ``backend=``, ...)."""
        return self.head_kwargs(norm=self.norm, **extra)

    def head_kwargs(self, **extra) -> dict:
        """The keywords every per-head prologue op takes (heads, head_dim, eps, rotary pairing,
        norm weight offset: the variants' public ops, references and traced programs), with
        ``extra``."""
        return (
            dict(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                eps=self.eps,
                is_neox=self.is_neox,
                weight_offset=self.weight_offset,
            )
            | extra
        )


@dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position: int
    norm: str = "head"
    eps: float = 1e-6
    weight_offset: float = 0.0
    partial_rotary_factor: float = 1.0
    is_neox: bool = True
    rope_scaling: tuple = field(default=())  # (("rope_type", "llama3"), ("factor", 8.0), ...)
    # The member of the prologue family this model runs (fqr.prologue.VARIANTS) and its own
    # fields as (name, value) pairs (e.g. (("mrope_section", (11, 11, 10)), ...)).
    variant: str = "split-qkv"
    variant_params: tuple = field(default=())
    tp: int = 1
    total_heads: int = 0  # unsharded q heads (set by __post_init__ when 0)
    total_kv_heads: int = 0
    # The model's hidden_size (config.hidden_size; 0: not recorded): the in_features of the
    # projection whose output the op reads (the bench's "after GEMM" floor).
    hidden_size: int = 0

    def __post_init__(self):
        self._check_rope()
        self.spec  # noqa: B018  (builds the spec, which checks the prologue's parameters)
        if not self.total_heads:
            object.__setattr__(self, "total_heads", self.num_heads)
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)

    def _check_rope(self) -> None:
        """The fields the table is built from (a NaN table, a ZeroDivisionError or an
        OverflowError otherwise): ``rope_theta`` and the ``rope_scaling`` pairs
        (:func:`fqr.rope_cache.check_rope`), ``max_position`` an int >= 1,
        ``partial_rotary_factor`` in ``(0, 1]``; ``head_dim`` first (``rotary_dim`` is made
        from it)."""
        try:
            scaling = dict(self.rope_scaling)
        except (TypeError, ValueError):
            raise TypeError(
                f"rope_scaling must be (key, value) pairs, got {self.rope_scaling!r}"
            ) from None
        check_rope(
            self.rope_theta,
            scaling,
            theta_name="rope_theta",
            key_name=lambda key: f"rope_scaling[{key!r}]",
        )
        positive_count("max_position", self.max_position)
        check_positive_int("head_dim", self.head_dim)
        fraction("partial_rotary_factor", self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config, *, name: str | None = None) -> Preset:
        """The preset of a Hugging Face transformers config of a supported family (see
        :func:`preset_from_hf_config`)."""
        return preset_from_hf_config(config, name=name)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @cached_property
    def spec(self) -> PrologueSpec:
        """The static parameters of this model's prologue (of one rank, for a TP view)."""
        return PrologueSpec.of(self)

    def shard(self, tp: int) -> Preset:
        """The per-rank view at tensor-parallel size ``tp`` (see module docstring)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if self.tp != 1:
            raise ValueError(f"preset {self.name} is already a tp={self.tp} view")
        if self.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide {self.name}'s {self.num_heads} q heads")
        if self.num_kv_heads >= tp:
            if self.num_kv_heads % tp:
                raise ValueError(
                    f"tp={tp} does not divide {self.name}'s {self.num_kv_heads} kv heads"
                )
            kv = self.num_kv_heads // tp
        else:
            if tp % self.num_kv_heads:
                raise ValueError(
                    f"tp={tp} is not a multiple of {self.name}'s {self.num_kv_heads} kv heads"
                )
            kv = 1
        return replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=kv,
            tp=tp,
            total_heads=self.num_heads,
            total_kv_heads=self.num_kv_heads,
        )

    def kv_head_owner(self, tp_rank: int) -> int:
        """Index of the first (unsharded) kv head that TP rank ``tp_rank`` holds."""
        if self.total_kv_heads >= self.tp:
            return tp_rank * self.num_kv_heads
        return tp_rank * self.total_kv_heads // self.tp

    @property
    def params(self) -> dict:
        """The variant's fields (:attr:`variant_params`) as a dict."""
        return dict(self.variant_params)

    @property
    def label(self) -> str:
        return self.name if self.tp == 1 else f"{self.name}@tp{self.tp}"

    def cos_sin_cache(self, max_position: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """The model's real RoPE table in vLLM layout ``[max_position, rotary_dim]``."""
        return rope_cos_sin_cache(
            self.rotary_dim,
            max_position or self.max_position,
            self.rope_theta,
            scaling=dict(self.rope_scaling),
            dtype=dtype,
        )

    @cached_property
    def summary(self) -> str:
        return (
            f"{self.label}: hq={self.num_heads} hkv={self.num_kv_heads} d={self.head_dim} "
            f"rotary={self.rotary_dim} {'neox' if self.is_neox else 'gptj'} norm={self.norm}"
            f" eps={self.eps:g} offset={self.weight_offset:g} theta={self.rope_theta:g}"
            + ("" if self.variant == "split-qkv" else f" variant={self.variant}")
            + "".join(f" {k}={v}" for k, v in self.variant_params)
        )


_LLAMA3_SCALING = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)

_LLAMA4_SCALING = (
    ("rope_type", "llama3"),
    ("factor", 16.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
)

# DeepSeek's YaRN (fqr.rope_cache, vLLM DeepseekScalingRotaryEmbedding): the config.json's
# rope_scaling, keys in this order; mscale == mscale_all_dim, so cos/sin are not scaled.
_DEEPSEEK_V3_YARN = (
    ("rope_type", "yarn"),
    ("factor", 40.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)

_DEEPSEEK_V2_LITE_YARN = (
    ("rope_type", "yarn"),
    ("factor", 40.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 0.707),
    ("mscale_all_dim", 0.707),
)

_KIMI_K2_YARN = (
    ("rope_type", "yarn"),
    ("factor", 32.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 1.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)


def _mla_preset(
    name: str,
    hf_id: str,
    heads: int,
    theta: float,
    max_position: int,
    scaling: tuple,
    q_lora_rank: int,
    cache_dtype: str = "auto",
    hidden_size: int = 7168,
) -> Preset:
    """An MLA preset (the conventions in the comment above the MLA presets): ``heads`` q heads,
    one latent / rope key head, the 64-wide rope part as the spec's head, GPT-J pairs, the
    YaRN ``scaling``, and the ``mla-kv`` variant's fields, in order: ``q_lora_rank`` (0: the
    model has none, q is one ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``v_head_dim`` (512 / 128 / 128 in every DeepSeek-V2/V3 and Kimi-K2 config),
    ``block_size`` 64 (vLLM's paged MLA cache: the size vLLM forces for its FlashMLA and
    FlashMLA-sparse backends, the Hopper defaults; CUTLASS MLA on Blackwell takes 128) and
    ``cache_dtype`` (vLLM's ``kv_cache_dtype``: ``auto`` = the model dtype, ``fp8`` = E4M3
    with a per-tensor scale, ``fp8_ds_mla`` = V3.2's 656-byte entry); ``hidden_size``: 7168 in
    DeepSeek-V3/V3.2 and Kimi-K2, 2048 in DeepSeek-V2-Lite."""
    params = (
        ("q_lora_rank", q_lora_rank),
        ("kv_lora_rank", 512),
        ("qk_nope_head_dim", 128),
        ("v_head_dim", 128),
        ("block_size", 64),
        ("cache_dtype", cache_dtype),
    )
    return Preset(
        name,
        hf_id,
        heads,
        1,
        64,
        theta,
        max_position,
        is_neox=False,
        rope_scaling=scaling,
        variant="mla-kv",
        variant_params=params,
        hidden_size=hidden_size,
    )


_LLAMA4_SCOUT = Preset(
    "llama4-scout",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    40,
    8,
    128,
    5e5,
    10485760,
    norm="none",
    eps=1e-5,
    is_neox=False,
    rope_scaling=_LLAMA4_SCALING,
    variant="rope-l2norm",
    hidden_size=5120,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", 16, 8, 128, 1e6, 40960, hidden_size=1024),
        Preset("qwen3-8b", "Qwen/Qwen3-8B", 32, 8, 128, 1e6, 40960, hidden_size=4096),
        # The stand-alone paged KV insert (vLLM's reshape_and_cache_flash) of Qwen3-8B's 8 KV
        # heads of 128 (config.json), vLLM's default block size 16 (CacheConfig.block_size):
        # a cache in the model dtype (kv_cache_dtype "auto") and an FP8 E4M3 one
        *(
            Preset(
                name,
                "Qwen/Qwen3-8B",
                32,
                8,
                128,
                1e6,
                40960,
                hidden_size=4096,
                variant="kv-insert",
                variant_params=(("block_size", 16), ("cache_dtype", cache)),
            )
            for name, cache in (
                ("qwen3-8b-kv-insert", "auto"),
                ("qwen3-8b-kv-insert-fp8", "fp8e4m3"),
                ("qwen3-8b-kv-insert-fp8-e5m2", "fp8e5m2"),  # vLLM's kv_cache_dtype fp8_e5m2
            )
        ),
        Preset("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128, 1e6, 40960, hidden_size=5120),
        Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 32, 4, 128, 1e6, 40960, hidden_size=2048),
        Preset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 64, 4, 128, 1e6, 40960, hidden_size=4096),
        # Gemma 3 global-attention layers (theta 1e6); Gemma norms scale by (1 + w).
        Preset(
            "gemma3-1b",
            "google/gemma-3-1b-it",
            4,
            1,
            256,
            1e6,
            32768,
            weight_offset=1.0,
            hidden_size=1152,
        ),
        Preset(
            "gemma3-27b",
            "google/gemma-3-27b-it",
            32,
            16,
            128,
            1e6,
            131072,
            weight_offset=1.0,
            hidden_size=5376,
        ),
        # Qwen3.5 full-attention layers (Qwen/Qwen3.5-27B config.json, text_config):
        # num_attention_heads 24, num_key_value_heads 4, head_dim 256, rms_norm_eps 1e-6,
        # max_position_embeddings 262144, attn_output_gate true (each q head followed by its
        # gate head: vLLM Qwen3NextAttention), rope_parameters: rope_theta 1e7,
        # partial_rotary_factor 0.25 (rotary 64 of 256), mrope_section [11, 11, 10],
        # mrope_interleaved true; (1 + w) norms (Qwen3NextRMSNorm / vLLM GemmaRMSNorm).
        Preset(
            "qwen3.5-27b",
            "Qwen/Qwen3.5-27B",
            24,
            4,
            256,
            1e7,
            262144,
            weight_offset=1.0,
            partial_rotary_factor=0.25,
            variant="mrope-gate",
            variant_params=(("mrope_section", (11, 11, 10)), ("mrope_interleaved", True)),
            hidden_size=5120,
        ),
        Preset(
            "olmo2-7b",
            "allenai/OLMo-2-1124-7B",
            32,
            32,
            128,
            5e5,
            4096,
            norm="full",
            hidden_size=4096,
        ),
        Preset(
            "llama3-8b",
            "meta-llama/Llama-3.1-8B",
            32,
            8,
            128,
            5e5,
            131072,
            norm="none",
            eps=1e-5,
            rope_scaling=_LLAMA3_SCALING,
            hidden_size=4096,
        ),
        Preset(
            "glm4-9b",
            "THUDM/glm-4-9b-chat",
            32,
            2,
            128,
            1e4,
            131072,
            norm="none",
            eps=1.5625e-7,
            partial_rotary_factor=0.5,
            is_neox=False,
            hidden_size=4096,
        ),
        # Qwen/Qwen3-VL-8B-Instruct config.json, text_config: num_attention_heads 32,
        # num_key_value_heads 8, head_dim 128, rms_norm_eps 1e-6, rope_theta 5e6,
        # max_position_embeddings 262144, rope_scaling: mrope_section [24, 20, 20],
        # mrope_interleaved true (vLLM Qwen3VLForConditionalGeneration: Qwen3 attention with
        # MRotaryEmbedding; per-head RMSNorm, offset 0).
        Preset(
            "qwen3-vl-8b",
            "Qwen/Qwen3-VL-8B-Instruct",
            32,
            8,
            128,
            5e6,
            262144,
            variant="mrope",
            variant_params=(("mrope_section", (24, 20, 20)), ("mrope_interleaved", True)),
            hidden_size=4096,
        ),
        # Gemma 4 31B (google/gemma-4-31B-it config.json, text_config): num_attention_heads 32,
        # head_dim 256, num_key_value_heads 16, rms_norm_eps 1e-6, max_position_embeddings 262144;
        # sliding_attention layers: rope_parameters rope_theta 1e4, rope_type default (whole
        # head). q_norm/k_norm are vLLM's RMSNorm (x * w, offset 0), v_norm has no weight
        # (vllm/model_executor/models/gemma4.py, Gemma4Attention).
        Preset(
            "gemma4-31b-sliding",
            "google/gemma-4-31B-it",
            32,
            16,
            256,
            1e4,
            262144,
            variant="split-qkv-vnorm",
            hidden_size=5376,
        ),
        # Gemma 4 31B full_attention layers: global_head_dim 512, num_global_key_value_heads 4
        # (attention_k_eq_v: v's slot holds k's weights, the row stays [q | k | v]);
        # rope_parameters.full_attention: rope_theta 1e6, rope_type proportional,
        # partial_rotary_factor 0.25 -- a full-width table whose last 3/4 frequencies are 0
        # (vLLM Gemma4RotaryEmbedding; fqr.rope_cache).
        Preset(
            "gemma4-31b-full",
            "google/gemma-4-31B-it",
            32,
            4,
            512,
            1e6,
            262144,
            rope_scaling=(("rope_type", "proportional"), ("partial_rotary_factor", 0.25)),
            variant="split-qkv-vnorm",
            hidden_size=5376,
        ),
        # Llama 4 Scout RoPE layers (meta-llama/Llama-4-Scout-17B-16E-Instruct config.json,
        # text_config): num_attention_heads 40, num_key_value_heads 8, head_dim 128, rope_theta
        # 5e5, rms_norm_eps 1e-5 (the L2 norm's eps), max_position_embeddings 10485760,
        # rope_scaling llama3 (factor 16, low/high_freq_factor 1, original 8192). Hugging Face's
        # layout: interleaved GPT-J pairs (complex multiplication); vLLM permutes q/k at load
        # and rotates NeoX halves (vllm/model_executor/models/llama4.py).
        _LLAMA4_SCOUT,
        # Llama 4 Scout NoPE layers (no_rope_layers: every 4th layer): no RoPE, no QK norm, q
        # scaled by the attention temperature (config attn_temperature_tuning, floor_scale 8192,
        # attn_scale 0.1; vLLM Llama4Attention._get_attn_scale).
        replace(
            _LLAMA4_SCOUT,
            name="llama4-scout-nope",
            variant="nope-temperature",
            variant_params=(("floor_scale", 8192.0), ("attn_scale", 0.1)),
        ),
        # MiniMax-M3's sparse-attention layers: heads 64 / kv 4, head_dim 128, rotary_dim 64,
        # index heads 4 (== kv heads, asserted and sharded alike by vllm-ascend's
        # MiniMaxM3SparseAttention) of sparse_index_dim 128, q / k / index q / index k under
        # GemmaRMSNorm, (1 + w) (vllm_ascend/models/minimax_m3/minimax_m3.py and its tests);
        # max_position_embeddings 1048576 (release notes). rope_theta 5e6 and rms_norm_eps
        # 1e-6 as the released text_config pinned in an SGLang fork's MiniMax-M3 layer
        # benchmark (FrankLeeeee/sglang benchmarks/minimax_m3_sparse_attn/bench_layer.py,
        # FALLBACK_TEXT_CONFIG, which also gives rotary_dim 64, index heads 4 of 128) and
        # other public test configs; MiniMaxAI/MiniMax-M3's config.json itself was not read
        # (unreachable from here).
        *(
            Preset(
                name,
                "MiniMaxAI/MiniMax-M3",
                64,
                4,
                128,
                5e6,
                1048576,
                weight_offset=1.0,
                partial_rotary_factor=0.5,
                variant=variant,
                variant_params=params,
                hidden_size=6144,
            )
            for name, variant, params in (
                # the indexer heads, bf16 outputs / FP8 E4M3 outputs (vllm-ascend's
                # attn_out_fp8 and indexer_out_fp8, the A5 path)
                (
                    "minimax-m3",
                    "index-heads",
                    (("index_head_dim", 128), ("attn_fp8", False), ("index_fp8", False)),
                ),
                (
                    "minimax-m3-fp8",
                    "index-heads",
                    (("index_head_dim", 128), ("attn_fp8", True), ("index_fp8", True)),
                ),
                # the KV-cache insert (vllm-ascend's minimax_qknorm_rope_cache; its block
                # size 128): a cache in the model dtype (vLLM's kv_cache_dtype "auto") and
                # an FP8 E4M3 one with per-tensor scales
                ("minimax-m3-kvcache", "kv-cache", (("block_size", 128), ("cache_dtype", "auto"))),
                (
                    "minimax-m3-kvcache-fp8",
                    "kv-cache",
                    (("block_size", 128), ("cache_dtype", "fp8e4m3")),
                ),
                # the whole sparse-attention prologue with its caches (vllm-ascend's
                # minimax_qknorm_rope_cache): the KV cache and the index cache (its own slot
                # mapping) in the model dtype / in FP8 E4M3 (index_q returned in FP8)
                (
                    "minimax-m3-index-cache",
                    "index-cache",
                    (("index_head_dim", 128), ("block_size", 128), ("cache_dtype", "auto")),
                ),
                (
                    "minimax-m3-index-cache-fp8",
                    "index-cache",
                    (("index_head_dim", 128), ("block_size", 128), ("cache_dtype", "fp8e4m3")),
                ),
            )
        ),
        # Packed rows read as the checkpoint stores them (variant split-qkv-layout, the split
        # op's qkv_layout; no QK norm). EleutherAI/pythia-6.9b config.json (GPTNeoXConfig):
        # hidden_size 4096, num_attention_heads 32 (head_dim 128), rotary_pct 0.25 (32 of 128
        # features rotated, NeoX halves: HF GPTNeoX's rotate_half), rotary_emb_base 10000,
        # max_position_embeddings 2048; its query_key_value row is per head [q_h | k_h | v_h]
        # (GPTNeoXAttention: view(..., H, 3 * D).chunk(3)).
        Preset(
            "pythia-6.9b",
            "EleutherAI/pythia-6.9b",
            32,
            32,
            128,
            1e4,
            2048,
            norm="none",
            partial_rotary_factor=0.25,
            variant="split-qkv-layout",
            variant_params=(("qkv_layout", "per-head"),),
            hidden_size=4096,
        ),
        # Salesforce/codegen-2B-mono config.json (CodeGenConfig): n_embd 2560, n_head 32
        # (head_dim 80), rotary_dim 64 (GPT-J pairs: HF rotate_every_two), n_positions 2048,
        # theta 10000 (HF create_sinusoidal_positions fixes it); CodeGenAttention's mp_num = 4:
        # the row is 4 shards of [q | v | k], 8 heads each.
        Preset(
            "codegen-2b",
            "Salesforce/codegen-2B-mono",
            32,
            32,
            80,
            1e4,
            2048,
            norm="none",
            partial_rotary_factor=0.8,
            is_neox=False,
            variant="split-qkv-layout",
            variant_params=(("qkv_layout", "codegen-mp4"),),
            hidden_size=2560,
        ),
        # LayerNorm on q and k (variant qk-layernorm). adept/persimmon-8b-base config.json
        # (PersimmonConfig): hidden_size 4096, num_attention_heads 64 (head_dim 64),
        # partial_rotary_factor 0.5 (NeoX halves), rope_theta 25000, max_position_embeddings
        # 16384, layer_norm_eps 1e-5, qk_layernorm true: nn.LayerNorm(head_dim) with weight and
        # bias, one for every head; its query_key_value row is per head (view(..., H, 3, D)).
        Preset(
            "persimmon-8b",
            "adept/persimmon-8b-base",
            64,
            64,
            64,
            2.5e4,
            16384,
            norm="none",
            eps=1e-5,
            partial_rotary_factor=0.5,
            variant="qk-layernorm",
            variant_params=(("qkv_layout", "per-head"), ("norm_weights", "shared")),
            hidden_size=4096,
        ),
        # facebook/chameleon-7b config.json (ChameleonConfig): hidden_size 4096,
        # num_attention_heads 32, num_key_value_heads 32 (head_dim 128), rope_theta 10000,
        # max_position_embeddings 4096; q_norm / k_norm are ChameleonLayerNorm((H, D)): the
        # statistics per head, eps 1e-5 fixed in its forward, weight and bias [H, D] (each head
        # its own) applied after the norm; q_proj, k_proj, v_proj back to back.
        Preset(
            "chameleon-7b",
            "facebook/chameleon-7b",
            32,
            32,
            128,
            1e4,
            4096,
            norm="none",
            eps=1e-5,
            variant="qk-layernorm",
            variant_params=(("qkv_layout", "qkv"), ("norm_weights", "per-head")),
            hidden_size=4096,
        ),
        # RMSNorm after RoPE (variant rope-rmsnorm). tencent/Hunyuan-A13B-Instruct config.json
        # (model_type hunyuan_v1_moe; the values as recalled, to check against the file):
        # hidden_size 4096, num_attention_heads 32, num_key_value_heads 8, head_dim 128,
        # rms_norm_eps 1e-5, max_position_embeddings 32768, rope_theta 10000 with rope_scaling
        # {type "dynamic", alpha 1000}: HF's HunYuanMoEV1RotaryEmbedding reads that as NTK-alpha,
        # base = rope_theta * alpha ** (D / (D - 2)), the theta here. use_qk_norm: q and k
        # rotated (NeoX halves), then query_layernorm / key_layernorm per head.
        Preset(
            "hunyuan-a13b",
            "tencent/Hunyuan-A13B-Instruct",
            32,
            8,
            128,
            1e4 * 1000.0 ** (128 / 126),
            32768,
            eps=1e-5,
            variant="rope-rmsnorm",
            hidden_size=4096,
        ),
        # Multi-head Latent Attention (DeepSeek-V2/V3/V3.2, Kimi-K2): the records the MLA op
        # declarations mla-kv (the [kv_c | k_pe] row) and mla-q-rope (the rope part of each q
        # head) read. The "head" of the spec is the rotated part: head_dim = qk_rope_head_dim
        # 64, rotary_dim 64; q heads = num_attention_heads (TP divides them), one kv head (the
        # latent and k_pe, replicated under TP). GPT-J pairs (vLLM deepseek_v2.py:
        # get_rope(qk_rope_head_dim, is_neox_style=False)), the yarn table of vLLM's
        # DeepseekScalingRotaryEmbedding (its rope_type "deepseek_yarn"), max_position_embeddings
        # rows (= original_max_position_embeddings * factor, the rows vLLM's table has).
        #
        # deepseek-ai/DeepSeek-V3 config.json: num_attention_heads 128, q_lora_rank 1536,
        # kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
        # rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings 163840, rope_scaling
        # {type yarn, factor 40, original_max_position_embeddings 4096, beta_fast 32,
        # beta_slow 1, mscale 1.0, mscale_all_dim 1.0} (read from verbatim copies of the
        # V3 / R1 config.json pinned in public test fixtures; the same numbers as
        # deepseek-ai/DeepSeek-V3's inference/configs/config_671B.json and ModelArgs defaults
        # of its inference/model.py: original_seq_len 4096, rope_factor 40, beta 32 / 1,
        # mscale 1, RMSNorm eps 1e-6). Cache "auto": vLLM's default kv_cache_dtype; "fp8":
        # kv_cache_dtype="fp8", E4M3 with a per-tensor scale (concat_and_cache_mla).
        *(
            _mla_preset(
                name, "deepseek-ai/DeepSeek-V3", 128, 1e4, 163840, _DEEPSEEK_V3_YARN, 1536, cache
            )
            for name, cache in (("deepseek-v3", "auto"), ("deepseek-v3-fp8", "fp8"))
        ),
        # deepseek-ai/DeepSeek-V3.2-Exp: the attention dims and rope of V3 (transformers'
        # DeepseekV32Config, whose defaults are that checkpoint's: heads 128, q_lora_rank
        # 1536, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, rms_norm_eps 1e-6,
        # max_position_embeddings 163840; deepseek-ai/DeepSeek-V3.2-Exp's
        # inference/config_671B_v3.2.json and model.py: the same dims, yarn 4096 x 40,
        # beta 32 / 1, mscale 1, theta 1e4; its config.json's rope_scaling as V3's, read from
        # public fixtures of it). Cache "fp8_ds_mla": vLLM's DeepseekV32ForCausalLM turns
        # kv_cache_dtype "auto" (and "fp8*") into it (vllm/model_executor/models/config.py),
        # the 656-byte entry of concat_and_cache_ds_mla. Its lightning indexer (index heads
        # 64 x 128, a LayerNorm and RoPE of its own) is not part of this prologue.
        _mla_preset(
            "deepseek-v3.2",
            "deepseek-ai/DeepSeek-V3.2-Exp",
            128,
            1e4,
            163840,
            _DEEPSEEK_V3_YARN,
            1536,
            "fp8_ds_mla",
        ),
        # moonshotai/Kimi-K2-Instruct config.json (model_type "kimi_k2", architectures
        # DeepseekV3ForCausalLM: MoonshotAI/Kimi-K2's deploy guidance says the model type is
        # there so engines tell it from DeepSeek-V3, whose code runs it): num_attention_heads
        # 64, q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
        # v_head_dim 128, rms_norm_eps 1e-6, rope_theta 50000, max_position_embeddings 131072,
        # rope_scaling {type yarn, factor 32, original_max_position_embeddings 4096, beta_fast
        # 1.0, beta_slow 1.0, mscale 1.0, mscale_all_dim 1.0} (the config.json itself not read:
        # the values several public copies of it agree on; heads 64 and 128K context also in
        # MoonshotAI/Kimi-K2's README; Kimi-K2-Instruct-0905 differs: factor 64, 262144).
        _mla_preset("kimi-k2", "moonshotai/Kimi-K2-Instruct", 64, 5e4, 131072, _KIMI_K2_YARN, 1536),
        # deepseek-ai/DeepSeek-V2-Lite config.json: num_attention_heads 16, q_lora_rank null
        # (q is one q_proj: 0 here), kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
        # 128, v_head_dim 128, rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings
        # 163840, rope_scaling {type yarn, factor 40, original_max_position_embeddings 4096,
        # beta_fast 32, beta_slow 1, mscale 0.707, mscale_all_dim 0.707} (a verbatim copy
        # pinned in a public test; deepseek-ai/DeepSeek-V3's inference/configs/config_16B.json
        # agrees: n_heads 16, q_lora_rank 0, mscale 0.707).
        _mla_preset(
            "deepseek-v2-lite",
            "deepseek-ai/DeepSeek-V2-Lite",
            16,
            1e4,
            163840,
            _DEEPSEEK_V2_LITE_YARN,
            0,
            hidden_size=2048,
        ),
    ]
}

# An op a model's layer calls beside its own prologue is a preset of its own, named
# ``{model}-{suffix}``, with the model's fields and the op's variant: the MLA models' query
# rotation (mla-q-rope: after q_b_proj, the rope part of each q head rotated in place), and the
# RoPE of separate q and k as vLLM's attention layers call ``rotary_emb(positions, q, k)``
# (qk-rope on Llama 3 and GLM-4; qk-mrope, ``MRotaryEmbedding.forward``, on Qwen3-VL and
# Qwen3.5).
_SECOND_OPS = (
    ("deepseek-v3", "q-rope", "mla-q-rope"),
    ("kimi-k2", "q-rope", "mla-q-rope"),
    ("deepseek-v2-lite", "q-rope", "mla-q-rope"),
    # the query rotation with FP8 outputs (FlashInfer's mla_rope_quantize_fp8 q)
    ("deepseek-v3", "q-rope-fp8", "mla-q-rope-fp8"),
    # the MLA cache insert alone (vLLM's concat_and_cache_mla / _ds_mla), per cache flavour
    ("deepseek-v3", "mla-insert", "mla-insert"),
    ("deepseek-v3-fp8", "mla-insert", "mla-insert"),
    ("deepseek-v3.2", "mla-insert", "mla-insert"),
    # the MLA prologue returning an FP8 q_c (quant_scale_q: what an FP8 q_b_proj reads)
    ("deepseek-v3.2", "fp8-q", "mla-kv-fp8-q"),
    # the MLA prologue into FlashInfer's two caches (ckv_cache, kpe_cache)
    ("deepseek-v3", "two-caches", "mla-kv-two-caches"),
    ("llama3-8b", "qk-rope", "qk-rope"),
    ("glm4-9b", "qk-rope", "qk-rope"),
    ("qwen3-vl-8b", "qk-mrope", "qk-mrope"),
    ("qwen3.5-27b", "qk-mrope", "qk-mrope"),
)
PRESETS.update(
    (f"{model}-{suffix}", replace(PRESETS[model], name=f"{model}-{suffix}", variant=variant))
    for model, suffix, variant in _SECOND_OPS
)
# The MLA cache insert into an FP8 E5M2 cache (vLLM's kv_cache_dtype "fp8_e5m2": DeepSeek-V3's
# dims, its cache E5M2 with a per-tensor scale)
PRESETS["deepseek-v3-fp8-e5m2-mla-insert"] = replace(
    PRESETS["deepseek-v3-fp8-mla-insert"],
    name="deepseek-v3-fp8-e5m2-mla-insert",
    variant_params=tuple(
        (k, "fp8_e5m2" if k == "cache_dtype" else v)
        for k, v in PRESETS["deepseek-v3-fp8-mla-insert"].variant_params
    ),
)


# The preset a command or a config uses when none is named.
DEFAULT_PRESET = "qwen3-8b"


def get_preset(name: str, tp: int = 1) -> Preset:
    """The preset called ``name`` (lower case, e.g. ``qwen3-8b``), viewed at TP size ``tp``."""
    preset = lookup(PRESETS, name, "preset")
    return preset.shard(tp) if tp != 1 else preset


# ------------------------------------------------------------------- from a transformers config


@dataclass(frozen=True)
class HFFamily:
    """What a model family's attention code does that its config does not say: the QK-norm
    kind, the norm's weight offset (1.0: ``(1 + w)``), the RoPE pairing and the RoPE scalings
    vLLM builds for it the way :mod:`fqr.rope_cache` does, as vLLM's model code for the family
    has them."""

    norm: str
    weight_offset: float = 0.0
    is_neox: bool = True
    note: str = ""
    # mrope / mrope-gate: mrope_section read from the RoPE settings; mla-kv: the MLA dims
    variant: str = "split-qkv"
    # mRoPE as the family's code reads it: ``mrope_section`` where the config has none (the
    # code's ``rope_parameters.get("mrope_section", default)``; None: required), and the
    # interleaving the code always applies (True: Qwen3-VL / Qwen3.5's rotary embedding
    # interleaves whatever ``mrope_interleaved`` says; None: read from the config, missing False)
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool | None = None
    # An mRoPE variant's prologue with plain RoPE (positions [T]; Qwen3-Next's gated q): every
    # frequency from one plane, mrope_section (rotary_dim / 2, 0, 0), no mRoPE key read
    mrope_one_plane: bool = False
    # Config settings with which the family's attention does what fqr has no form for:
    # (key, the value that leaves it out, what it does); another value is refused
    refused_keys: tuple[tuple[str, object, str], ...] = ()
    # The config key of the QK norms' eps (LFM2: norm_eps)
    eps_key: str = "rms_norm_eps"
    # The config key that picks the QK-norm kind, and the kind each of its values gives (a
    # value not listed is refused; a config without the key: ``norm``)
    norm_key: str | None = None
    norm_kinds: tuple[tuple[object, str], ...] = ()
    # The numerics mode in which fqr's op equals the family's transformers code bit for bit
    # (fqr.numerics: "unfused-hf" where HF rounds elsewhere than vLLM, OLMo 2's full-width
    # norms, DeepSeek-V2's fp32 complex RoPE)
    numerics: str = "unfused"
    scalings: tuple[str, ...] = ("default", "linear", "llama3")
    # The config key the family's code reads for its RoPE pairing, as that code reads it
    # (transformers' DeepseekV3Attention: ``if self.config.rope_interleave`` -> GPT-J pairs,
    # else NeoX halves); None: the code reads none and ``is_neox`` holds whatever the config
    # says (DeepSeek-V2 and V3.2 always rotate GPT-J pairs).
    interleave_key: str | None = None
    # Config keys the family's code needs present (DeepseekV32Attention always builds q_a_proj)
    required: tuple[str, ...] = ()
    # vLLM's kv_cache_dtype for the family's default ("auto"): V3.2 runs "fp8_ds_mla"
    cache_dtype: str = "auto"
    # The norm eps the family's code uses whatever rms_norm_eps says (transformers builds
    # DeepSeek's q_a_layernorm / kv_a_layernorm with its 1e-6 default; vLLM passes
    # rms_norm_eps): another rms_norm_eps would make the two differ, and is refused
    fixed_eps: float | None = None


# DeepSeek's attention (vLLM DeepseekV2Attention and the MLA attention of
# vllm/model_executor/models/deepseek_v2.py, which also runs Kimi-K2): GPT-J pairs, and any
# non-default rope_type becomes "deepseek_yarn" (DeepseekScalingRotaryEmbedding).
_MLA = {
    "norm": "head",
    "is_neox": False,
    "variant": "mla-kv",
    "scalings": ("default", "yarn"),
    "fixed_eps": 1e-6,
}

# Qwen3-VL / Qwen3.5: their rotary embedding always interleaves the sections
# (``apply_interleaved_mrope``; ``mrope_interleaved`` is never read) and defaults the sections
# to [24, 20, 20] / [11, 11, 10] (modeling_qwen3_vl.py / modeling_qwen3_5.py)
_QWEN3_VL = dict(norm="head", variant="mrope", mrope_section=(24, 20, 20), mrope_interleaved=True)
_QWEN3_5 = dict(
    norm="head",
    weight_offset=1.0,
    variant="mrope-gate",
    mrope_section=(11, 11, 10),
    mrope_interleaved=True,
)

# transformers ``model_type`` (of the text config) -> the family's prologue facts.
HF_FAMILIES: dict[str, HFFamily] = {
    "qwen3": HFFamily("head", note="Qwen3: per-head q_norm / k_norm"),
    "qwen3_moe": HFFamily("head", note="Qwen3-MoE: as Qwen3"),
    "gemma3_text": HFFamily("head", 1.0, note="Gemma 3: (1 + w) norms, the global layers"),
    "qwen3_5_text": HFFamily(**_QWEN3_5, note="Qwen3.5 full attention: gated q, (1 + w) norms"),
    "qwen3_5_moe_text": HFFamily(**_QWEN3_5, note="Qwen3.5-MoE full attention: as Qwen3.5"),
    "qwen3_vl_text": HFFamily(**_QWEN3_VL, note="Qwen3-VL: Qwen3 with interleaved mRoPE"),
    "qwen3_vl_moe_text": HFFamily(**_QWEN3_VL, note="Qwen3-VL-MoE: as Qwen3-VL"),
    # Qwen3-Omni's thinker: Qwen3-VL's rotary embedding (always interleaved, [24, 20, 20])
    "qwen3_omni_moe_text": HFFamily(**_QWEN3_VL, note="Qwen3-Omni thinker: as Qwen3-VL"),
    "llama": HFFamily("none", note="Llama 3: no QK norm"),
    "olmo2": HFFamily(
        "full", numerics="unfused-hf", note="OLMo 2: one norm over the whole q and the whole k"
    ),
    "glm": HFFamily("none", is_neox=False, note="GLM-4 (-hf): GPT-J pairs, no QK norm"),
    "glm4": HFFamily("none", is_neox=False, note="GLM-4-0414: GPT-J pairs, no QK norm"),
    # transformers' DeepseekV2 rotates with an fp32 complex product rounded once
    # (apply_rotary_emb), its norms round as vLLM's: "unfused-hf" of the MLA ops
    "deepseek_v2": HFFamily(
        **_MLA, numerics="unfused-hf", note="DeepSeek-V2: MLA, yarn, fp32 complex RoPE"
    ),
    "deepseek_v3": HFFamily(
        **_MLA, interleave_key="rope_interleave", note="DeepSeek-V3: MLA, yarn"
    ),
    # DeepseekV32Attention always rotates interleaved (apply_rotary_pos_emb_interleave) and
    # always has q_a_proj; vLLM's DeepseekV32ForCausalLM turns kv_cache_dtype "auto" into
    # "fp8_ds_mla" (the deepseek-v3.2 preset's comment). Its indexer is not this prologue.
    "deepseek_v32": HFFamily(
        **_MLA,
        required=("q_lora_rank",),
        cache_dtype="fp8_ds_mla",
        note="DeepSeek-V3.2: MLA, yarn, fp8_ds_mla cache",
    ),
    # Kimi-K2's config.json says model_type "kimi_k2" with architectures
    # DeepseekV3ForCausalLM (vLLM runs it as DeepSeek-V3).
    "kimi_k2": HFFamily(
        **_MLA, interleave_key="rope_interleave", note="Kimi-K2: DeepSeek-V3's attention"
    ),
    # DeepSeek-V3's MLA in other families' code (their q_a / kv_a norms, like DeepSeek's, use
    # the 1e-6 default whatever rms_norm_eps says: their configs' 1e-5 is refused, fixed_eps):
    # GLM-4.7-Flash reads rope_interleave; GLM-5 (DSA) always rotates interleaved, its indexer
    # is not this prologue; MiniCPM3 and HY-V4 rotate NeoX halves
    "glm4_moe_lite": HFFamily(
        **_MLA, interleave_key="rope_interleave", note="GLM-4.7-Flash: DeepSeek-V3's MLA"
    ),
    "glm_moe_dsa": HFFamily(**_MLA, note="GLM-5: DeepSeek-V3.2's MLA, GPT-J pairs"),
    # Ling 3 (BailingHybrid) MLA layers: always interleaved; its output gate is after attention
    "bailing_hybrid": HFFamily(**_MLA, note="Ling 3: DeepSeek's MLA, GPT-J pairs"),
    "minicpm3": HFFamily(**(_MLA | dict(is_neox=True)), note="MiniCPM3: MLA, NeoX halves"),
    "hy_v4": HFFamily(**(_MLA | dict(is_neox=True)), note="HY-V4: MLA, NeoX halves"),
    # Llama 4's RoPE layers (Llama4TextAttention): its fp32 complex RoPE (GPT-J pairs, HF's
    # weight layout) rounded once, then the weightless L2 norm with use_qk_norm (the
    # rope-l2norm variant, numerics "unfused-hf"); without use_qk_norm there is none
    "llama4_text": HFFamily(
        "none",
        is_neox=False,
        variant="rope-l2norm",
        numerics="unfused-hf",
        refused_keys=(("use_qk_norm", True, "no L2 norm after RoPE (another prologue)"),),
        note="Llama 4: RoPE, then a weightless L2 norm (its RoPE layers)",
    ),
    # Qwen3-Next's full-attention layers: Qwen3.5's gated q and (1 + w) norms with plain RoPE
    "qwen3_next": HFFamily(
        "head",
        1.0,
        variant="mrope-gate",
        mrope_one_plane=True,
        note="Qwen3-Next full attention: gated q, (1 + w) norms, plain RoPE",
    ),
    # GLM-4.5 / 4.6 (Glm4MoeAttention): per-head q_norm / k_norm only with use_qk_norm
    "glm4_moe": HFFamily(
        "none",
        norm_key="use_qk_norm",
        norm_kinds=((False, "none"), (True, "head")),
        note="GLM-4.5: as Llama, per-head QK norm with use_qk_norm",
    ),
    # Molmo 2's text model: Qwen3's per-head norms or OLMo 2's full-width ones (qk_norm_type)
    "molmo2_text": HFFamily(
        "head",
        norm_key="qk_norm_type",
        norm_kinds=(("qwen3", "head"), ("olmo", "full")),
        note="Molmo 2: qk_norm_type qwen3 (as Qwen3) or olmo (as OLMo 2)",
    ),
}
# Families whose attention prologue is one fqr already has, as transformers' code for each
# runs it (tests/core/test_hf_zoo.py holds each to the model's own attention, bit for bit);
# a family whose layers differ (sliding / NoPE layers) is the layers that apply RoPE.
_SAME_PROLOGUE = {
    "llama": (
        "arcee", "aria_text", "bamba", "bitnet", "cwm", "diffllama", "falcon_h1", "gemma", "gemma2",
        "granite", "granite4_vision_text", "granite_docling_text", "granite_swa", "granitemoe",
        "granitemoe_swa", "granitemoeshared", "hrm_text", "hyperclovax", "jais2", "minimax",
        "ministral", "mistral", "mixtral", "nemotron", "phi3", "phi4_multimodal", "phimoe",
        "qwen2", "qwen2_moe", "seed_oss", "smollm3", "solar_open", "starcoder2",
        "unlimited_ocr_text", "vaultgemma",
    ),
    "glm": ("helium",),
    "qwen3": (
        "apertus", "apertus1p5_text", "doge", "dots1", "exaone4", "exaone_moe", "hy_v3",
        "kolibri1", "laguna", "mellum",
    ),
    "olmo2": ("flex_olmo", "olmo_hybrid"),
    "deepseek_v3": ("axk1", "youtu"),
}  # fmt: skip
# OLMo / OLMoE clamp q, k and v to +-clip_qkv after the projection
_CLIP_QKV = (("clip_qkv", None, "q, k and v clamped after the projection"),)
# Full-width QK norms that round as Llama's RMSNorm (vLLM's and HF's code alike: "unfused")
_FULL_NORM_UNFUSED = ("olmoe", "minimax_m2")
# No QK norm, RoPE computed in fp32 from fp32 cos/sin and rounded once (``q.float() * cos``
# ... ``.to(dtype)``): the fused contract's arithmetic, bit for bit on the reference backend
_FP32_ROPE = {
    "ernie4_5": HFFamily("none", is_neox=False, numerics="fused", note="ERNIE 4.5: GPT-J pairs"),
}
_FP32_ROPE["ernie4_5_moe"] = replace(_FP32_ROPE["ernie4_5"], note="ERNIE 4.5 MoE: GPT-J pairs")
_FP32_ROPE["olmo"] = HFFamily(
    "none", numerics="fused", refused_keys=_CLIP_QKV, note="OLMo: no QK norm, fp32 RoPE"
)
HF_FAMILIES |= {
    model_type: replace(HF_FAMILIES[like], note=f"{model_type}: as {like}")
    for like, model_types in _SAME_PROLOGUE.items()
    for model_type in model_types
}
HF_FAMILIES |= {
    model_type: replace(HF_FAMILIES["olmo2"], numerics="unfused", note=f"{model_type}: as olmo2")
    for model_type in _FULL_NORM_UNFUSED
} | _FP32_ROPE
HF_FAMILIES["olmoe"] = replace(HF_FAMILIES["olmoe"], refused_keys=_CLIP_QKV)
# Phi / StableLM: as Llama (partial rotary), with a LayerNorm on q and k under qk_layernorm
_QK_LAYERNORM = (("qk_layernorm", False, "a LayerNorm (not RMSNorm) on q and k"),)
HF_FAMILIES |= {
    t: HFFamily("none", refused_keys=_QK_LAYERNORM, note=f"{t}: as Llama, partial rotary")
    for t in ("phi", "stablelm")
}
# Granite 4.0 hybrid: its attention layers run RoPE only with position_embedding_type "rope"
# (the default None: no RoPE, no prologue of fqr's)
HF_FAMILIES["granitemoehybrid"] = HFFamily(
    "none",
    refused_keys=(("position_embedding_type", "rope", "no RoPE"),),
    note="Granite 4.0 hybrid: as Llama with position_embedding_type rope",
)
# Families whose prologue is a variant (fqr.prologue), not the split-qkv op: why.
HF_VARIANT_FAMILIES: dict[str, str] = {
    "gemma4_text": "Gemma 4 also normalises v (the split-qkv-vnorm variant), its global layers "
    "have their own head sizes (global_head_dim, k = v with attention_k_eq_v), and its norms "
    "multiply the weight in fp32 (one rounding, which the variant's numerics do not define)",
    "minimax_m3_vl_text": "MiniMax-M3 packs indexer heads in the row (the indexer variant)",
}
# The variants whose preset carries mrope_section / mrope_interleaved
MROPE_VARIANTS = ("mrope", "mrope-gate", "qk-mrope")

# Qwen2-VL and kin: no QK norm, mRoPE of contiguous sections (their rotary embedding's
# ``freq.split(mrope_section)``, ``mrope_interleaved`` never read), with the code's default
# sections; vLLM's attention calls ``rotary_emb(positions, q, k)``: the qk-mrope variant
_QWEN2_VL = dict(norm="none", variant="qk-mrope", mrope_interleaved=False)
HF_FAMILIES |= {
    model_type: HFFamily(**_QWEN2_VL, mrope_section=section, note=f"{model_type}: qk-mrope")
    for section, model_types in (
        ((16, 24, 24), ("qwen2_vl_text", "qwen2_5_vl_text", "qwen2_5_omni_text")),
        ((16, 24, 24), ("paddleocr_vl_text",)),
        ((8, 12, 12), ("glm4v_moe_text", "glm_image_text")),
    )
    for model_type in model_types
}
# Cosmos 3 Edge: no QK norm, Qwen3-VL's always-interleaved mRoPE (recomposition_frequencies)
HF_FAMILIES["cosmos3_edge_text"] = HFFamily(
    **(_QWEN2_VL | dict(mrope_interleaved=True)),
    mrope_section=(24, 20, 20),
    note="Cosmos 3 Edge: qk-mrope, interleaved",
)
# GLM-4V and GLM-OCR rotate GPT-J pairs (rotate_half_llm)
HF_FAMILIES |= {
    model_type: HFFamily(
        **_QWEN2_VL, is_neox=False, mrope_section=(8, 12, 12), note=f"{model_type}: qk-mrope"
    )
    for model_type in ("glm4v_text", "glm_ocr_text")
}
HF_FAMILIES |= {
    "lfm2": HFFamily("head", eps_key="norm_eps", note="LFM2: per-head QK norms (norm_eps)"),
    "lfm2_moe": HFFamily("head", eps_key="norm_eps", note="LFM2-MoE: as LFM2"),
    "olmo3": replace(HF_FAMILIES["olmo2"], note="OLMo 3: as OLMo 2, the full-attention layers"),
}

# Families fqr builds no preset for, with what their attention prologue needs (read from their
# transformers modeling code; the zoo test prints each refusal).
_NEEDS = {
    "a LayerNorm (not RMSNorm) on q and k": ("persimmon",),
    "an RMSNorm after RoPE": ("hunyuan_v1_dense", "hunyuan_v1_moe"),
    "a fused qkv whose rows interleave per head": ("gpt_neox", "gpt_neox_japanese", "codegen"),
    "an MLA variant (latent scaling)": ("longcat_flash", "dots3_note", "dots3_note_text"),
    "an MLA variant (q temperature)": ("mistral_large4_text",),
    "an MLA variant (a gate fused with q)": ("axk2",),
    "an MLA variant with mRoPE": ("hy_v4_vl_text",),
    "a 3-D RoPE (its own position layout)": ("ernie4_5_vl_moe_text",),
    "xdrope (its own position layout)": ("hunyuan_vl_text",),
    "its own attention prologue (no fqr form yet)": ("deepseek_v4", "dory", "jetmoe", "zaya"),
    "Hugging Face's yarn table (truncate: false; fqr builds vLLM's DeepSeek yarn)": ("gpt_oss",),
    "Hugging Face's yarn table with llama_4_scaling_beta (fqr builds vLLM's DeepSeek yarn)": (
        "ministral3",
    ),
    "a preset builder reading rotary_dim and GPT-J's fixed RoPE base 10000 (no rope_theta)": (
        "gptj",
    ),
    "a preset builder for its fused query_key_value (multi_query: one k and one v head; "
    "new_decoder_architecture: rows interleaved per kv group)": ("falcon",),
    "a preset builder reading its attn_config (kv_n_heads, clip_qkv)": ("dbrx",),
    # measured by the zoo (tests/core/test_hf_zoo.py) on its tiny configs
    "a numerics mode: RoPE in fp32 from model-dtype cos/sin, rounded once (nearest: fused, "
    "up to 2e-3 absolute, 193 ULP where the rotation cancels)": (
        "cohere", "cohere2", "cohere2_moe", "modernbert-decoder",
    ),
    "a numerics mode: per-head QK norms that multiply the weight in fp32 before one rounding "
    "(nearest: unfused, up to 1.6e-2 absolute)": ("afmoe",),
    "proportional RoPE from a config and a numerics mode: per-head norms rounded as Llama's, "
    "RoPE in fp32 rounded once (nearest: unfused, up to 1.6e-2 absolute)": ("lfm3",),
    "the split-qkv-vnorm variant (v normalised too) with norms that multiply the weight in "
    "fp32 (one rounding, which the variant's numerics do not define)": (
        "gemma3n_text", "gemma4_unified_text",
    ),
    "RoPE by the negated angle (its rotate_half is cat(x2, -x1)), then a weightless norm": (
        "nanochat",
    ),
}  # fmt: skip
HF_NEEDS: dict[str, str] = {t: needs for needs, types in _NEEDS.items() for t in types}

# RoPE scalings fqr.rope_cache builds from a config, with the config keys each requires.
HF_ROPE_SCALINGS: dict[str, tuple[str, ...]] = {"default": ()} | {
    t: SCALING_REQUIRED[t] for t in ("linear", "llama3", "yarn")
}
# Keys a scaling may leave out, with the value vLLM uses then (yarn: the defaults of vLLM's
# DeepseekScalingRotaryEmbedding, fqr.rope_cache.YARN_DEFAULTS); the preset records them.
HF_ROPE_DEFAULTS: dict[str, tuple[tuple[str, float], ...]] = {
    "yarn": tuple(
        (k, YARN_DEFAULTS[k]) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    ),
}
# Keys a scaling carries only when the config has them (vLLM passes them through).
HF_ROPE_EXTRAS: dict[str, tuple[str, ...]] = {"yarn": ("attn_factor", "extrapolation_factor")}
# Config settings with which Hugging Face builds another yarn table than vLLM's DeepSeek path
# (which ignores them): refused rather than guessed; the value each may harmlessly have.
_YARN_REFUSED = {"attention_factor": None, "truncate": True}


def _required(text, key: str, model_type: str):
    """``text.<key>``; missing (or None): a ValueError naming it."""
    value = getattr(text, key, None)
    if value is None:
        raise ValueError(
            f"config.{key} is missing (a {model_type} config needs it to build a preset)"
        )
    return value


def _rope_parameters(config) -> tuple[dict, dict[str, str]]:
    """The RoPE settings of the layers the prologue runs in: transformers 5's
    ``rope_parameters`` (per layer type for Gemma 3: the ``full_attention`` ones), else
    4.x's ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` attributes; and where
    each was read (``config.rope_parameters['factor']``, ``config.rope_theta``, ...), the
    name an error about it gives."""
    params = getattr(config, "rope_parameters", None)
    where = "config.rope_parameters"
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params, where = params["full_attention"], f"{where}['full_attention']"
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"{where} must be a dict, got {type(params).__name__}")
    params = dict(params or {})
    origin = {key: f"{where}[{key!r}]" for key in params}
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"], origin["rope_theta"] = config.rope_theta, "config.rope_theta"
    scaling = getattr(config, "rope_scaling", None)
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"config.rope_scaling must be a dict, got {type(scaling).__name__}")
    if scaling and "rope_type" not in params:
        params |= scaling
        origin |= {key: f"config.rope_scaling[{key!r}]" for key in scaling}
    if getattr(config, "partial_rotary_factor", None) is not None:
        if "partial_rotary_factor" not in params:
            origin["partial_rotary_factor"] = "config.partial_rotary_factor"
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params, origin


def _scaling(rope: dict, origin: dict[str, str], rope_type: str, model_type: str) -> tuple:
    """The preset's ``rope_scaling`` pairs: the type, its required keys, the optional ones
    (vLLM's default where the config has none), then the extras the config has; each value
    checked (:func:`fqr.rope_cache.check_rope`, errors naming the config key) and held as the
    Python number it is."""
    if rope_type == "default":
        return ()
    if rope_type == "yarn":
        refused = [k for k, ok in _YARN_REFUSED.items() if rope.get(k, ok) != ok]
        if refused:
            raise ValueError(
                f"config: RoPE yarn ({model_type}) sets {', '.join(refused)}: with it Hugging "
                f"Face builds another table than vLLM's DeepSeek yarn (the one fqr builds)"
            )
    pairs = [(k, rope[k]) for k in HF_ROPE_SCALINGS[rope_type]]
    pairs += [
        (k, rope[k] if rope.get(k) is not None else v)
        for k, v in HF_ROPE_DEFAULTS.get(rope_type, ())
    ]
    pairs += [(k, rope[k]) for k in HF_ROPE_EXTRAS.get(rope_type, ()) if rope.get(k) is not None]
    checked = check_rope(
        rope["rope_theta"],
        {"rope_type": rope_type, **dict(pairs)},
        theta_name=origin.get("rope_theta", "config.rope_theta"),
        key_name=lambda key: origin.get(key, f"config RoPE {key}"),
    )
    return (("rope_type", rope_type), *((k, checked[k]) for k, _ in pairs))


def _mla_variant_params(text, model_type: str, family: HFFamily) -> tuple:
    """The ``mla-kv`` fields of a DeepSeek-style config (see :func:`preset_from_hf_config`)."""
    dims = {k: getattr(text, k, None) for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise ValueError(f"config: {model_type} (MLA) has no {', '.join(missing)}")
    q_lora_rank = getattr(text, "q_lora_rank", None)
    return (
        ("q_lora_rank", positive_count("config.q_lora_rank", q_lora_rank) if q_lora_rank else 0),
        *((k, positive_count(f"config.{k}", v)) for k, v in dims.items()),
        ("block_size", 64),
        ("cache_dtype", family.cache_dtype),
    )


def _norm_kind(text, model_type: str, family: HFFamily) -> str:
    """The QK-norm kind: the family's, or the one its :attr:`HFFamily.norm_key` value picks
    (a value the family's code does not take is refused, naming the key)."""
    key = family.norm_key
    if key is None or not hasattr(text, key):
        return family.norm
    value = getattr(text, key)
    kinds = dict(family.norm_kinds)
    if isinstance(value, (bool, str)) and value in kinds:
        return kinds[value]
    raise ValueError(
        f"config.{key} {value!r} ({model_type}): fqr builds "
        + ", ".join(f"{v!r} ({kind} norm)" for v, kind in family.norm_kinds)
    )


def _eps(text, model_type: str, family: HFFamily, norm: str) -> float:
    """The QK norms' eps, ``config.<family.eps_key>``: required where a norm reads it (any
    norm kind but "none", and MLA's q_a / kv_a norms); without a norm a missing one is the
    spec's default, which nothing reads."""
    key = family.eps_key
    if norm == "none" and family.variant == "split-qkv" and getattr(text, key, None) is None:
        return PrologueSpec.eps
    where = f"config.{key}"
    eps = positive_number(where, _required(text, key, model_type))
    check_finite_scalar(where, eps, positive=True)  # and within float32 (the compute dtype)
    if family.fixed_eps is not None and eps != family.fixed_eps:
        raise ValueError(
            f"{where} {eps!r} ({model_type}): Hugging Face's attention norms use "
            f"{family.fixed_eps!r} whatever it says, vLLM's use it: refused rather than guessed"
        )
    return eps


def _is_neox(text, family: HFFamily) -> bool:
    """The RoPE pairing the family's code takes from the config: ``family.interleave_key``
    read as that code reads it (a truth test: True / missing default True -> GPT-J pairs,
    False or None -> NeoX halves); a value of another type is refused, naming its key."""
    key = family.interleave_key
    if key is None or not hasattr(text, key):
        return family.is_neox
    value = getattr(text, key)
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"config.{key} must be a bool, got {type(value).__name__} {value!r}")
    return not value


def _hidden_size(text) -> int:
    """``config.hidden_size`` (a positive count), or 0 where the config has none."""
    hidden = getattr(text, "hidden_size", None)
    return 0 if hidden is None else positive_count("config.hidden_size", hidden)


def _head_counts(text, model_type: str) -> tuple[int, int, int, str]:
    """``(num_attention_heads, num_key_value_heads, head_dim, where head_dim comes from)`` of
    a config of grouped-query attention: only a missing (or None) ``num_key_value_heads``
    means one kv head per q head, and only a missing ``head_dim`` means ``hidden_size /
    num_attention_heads`` (as Hugging Face reads them; a 0 is refused, not read as missing)."""
    heads = positive_count(
        "config.num_attention_heads", _required(text, "num_attention_heads", model_type)
    )
    kv = getattr(text, "num_key_value_heads", None)
    kv_heads = heads if kv is None else positive_count("config.num_key_value_heads", kv)
    if heads % kv_heads:
        raise ValueError(
            f"config.num_attention_heads ({heads}) must be a multiple of "
            f"config.num_key_value_heads ({kv_heads})"
        )
    head_dim = getattr(text, "head_dim", None)
    if head_dim is not None:
        return heads, kv_heads, positive_count("config.head_dim", head_dim), "config.head_dim"
    hidden = positive_count("config.hidden_size", _required(text, "hidden_size", model_type))
    if hidden % heads:
        raise ValueError(
            f"config.hidden_size ({hidden}) is not a multiple of config.num_attention_heads "
            f"({heads}) and config.head_dim is missing"
        )
    return heads, kv_heads, hidden // heads, "config.hidden_size / config.num_attention_heads"


def _mrope_params(
    rope: dict, origin: dict[str, str], model_type: str, rotary_dim: int, family: HFFamily
) -> tuple:
    """``mrope_section`` (three ints summing to ``rotary_dim / 2``; missing: the family code's
    default, else refused) and ``mrope_interleaved`` (a bool; where the family's code always
    interleaves, :attr:`HFFamily.mrope_interleaved`, True whatever the config says, and an
    explicit False is refused: the model would rotate otherwise than the config says; else
    the config's, missing False) of an mRoPE family's RoPE settings."""
    if family.mrope_one_plane:
        return (("mrope_section", (rotary_dim // 2, 0, 0)), ("mrope_interleaved", False))
    section = rope.get("mrope_section")
    where = origin.get("mrope_section", f"{model_type}'s default mrope_section")
    if section is None:
        if family.mrope_section is None:
            raise ValueError(f"config: {model_type} runs mRoPE but has no mrope_section")
        section = family.mrope_section
    interleaved = rope.get("mrope_interleaved")
    if interleaved is not None and not isinstance(interleaved, bool):
        raise TypeError(
            f"{origin.get('mrope_interleaved')} must be a bool, got "
            f"{type(interleaved).__name__} {interleaved!r}"
        )
    if family.mrope_interleaved is not None:
        if interleaved is not None and interleaved != family.mrope_interleaved:
            raise ValueError(
                f"{origin['mrope_interleaved']} is {interleaved} but {model_type}'s code "
                f"ignores it and {'interleaves' if family.mrope_interleaved else 'does not'}"
                f": refused rather than guessed"
            )
        interleaved = family.mrope_interleaved
    elif interleaved is None:
        interleaved = False
    if isinstance(section, (list, tuple)):  # numpy ints as ints; anything else is refused
        section = [int(n) if isinstance(n, numbers.Integral) else n for n in section]
    try:
        check_mrope_section(section, interleaved, rotary_dim, config=True)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    return (("mrope_section", tuple(section)), ("mrope_interleaved", interleaved))


def preset_from_hf_config(config, *, name: str | None = None) -> Preset:
    """A :class:`Preset` from a Hugging Face ``PretrainedConfig`` of a family in
    :data:`HF_FAMILIES` (a multimodal config gives its text config's).

    Every key is read as the family's transformers code reads it, and every family is held to
    that code bit for bit by ``tests/core/test_hf_zoo.py`` (under :attr:`HFFamily.numerics`).
    Read from the config: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
    (else ``hidden_size / num_attention_heads``), the norm eps (:attr:`HFFamily.eps_key`,
    ``rms_norm_eps``; optional without a QK norm, where nothing reads it),
    ``max_position_embeddings`` and the RoPE settings (transformers 5 ``rope_parameters``, or
    4.x ``rope_theta`` / ``rope_scaling``): theta, ``partial_rotary_factor``, and the scaling,
    which must be one fqr builds for the family (:attr:`HFFamily.scalings`, keys in
    :data:`HF_ROPE_SCALINGS`; another is a ValueError naming its type); for an mRoPE family
    (:data:`MROPE_VARIANTS`: Qwen3-VL ``mrope``, Qwen3.5 ``mrope-gate``, Qwen2-VL kin
    ``qk-mrope``) its ``mrope_section`` (missing: the code's default) and
    ``mrope_interleaved`` (where the code ignores it, what the code does; a config saying
    otherwise is refused). From the family: the norm kind (or the one
    :attr:`HFFamily.norm_key` picks), its weight offset, the RoPE pairing and the variant; a
    setting the family's code applies that fqr has no form for (:attr:`HFFamily.refused_keys`)
    is refused naming it. Families whose prologue is another variant
    (:data:`HF_VARIANT_FAMILIES`) are refused, and any other model type with what it needs
    (:data:`HF_NEEDS`).

    Multi-head Latent Attention (``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``,
    ``kimi_k2``: the ``mla-kv`` variant, as vLLM's ``deepseek_v2.py`` runs them): ``num_heads``
    is ``num_attention_heads``, ``num_kv_heads`` 1 (the one latent / k_pe head, whatever
    ``num_key_value_heads`` says), ``head_dim`` = rotary_dim = ``qk_rope_head_dim``, GPT-J
    pairs (``deepseek_v3`` / ``kimi_k2``: NeoX halves where ``rope_interleave`` is false, as
    transformers' DeepseekV3Attention reads it; V2 and V3.2 rotate GPT-J pairs whatever it
    says), ``rms_norm_eps`` 1e-6 (transformers' DeepSeek q_a / kv_a norms use 1e-6 whatever
    the config says, vLLM's use the config's: another value is refused), and the variant's
    ``q_lora_rank`` (None: 0, a model with one ``q_proj``; required by ``deepseek_v32``),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``v_head_dim`` from the config, with
    ``block_size`` 64 and ``cache_dtype`` ``"auto"`` (``deepseek_v32``: ``"fp8_ds_mla"``, the
    cache vLLM runs V3.2 with), what vLLM runs these models with by default (its FlashMLA
    backend forces blocks of 64; ``kv_cache_dtype`` defaults to the model dtype). Their RoPE is
    ``default`` or ``yarn`` (vLLM turns any other type into DeepSeek's yarn too: refused here).
    A yarn scaling records ``factor``, ``original_max_position_embeddings`` (both required),
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim`` (missing: vLLM's
    ``DeepseekScalingRotaryEmbedding`` defaults 32, 1, 1, 0) and ``attn_factor`` /
    ``extrapolation_factor`` where the config has them; ``attention_factor`` and
    ``truncate: false`` (Hugging Face's, which vLLM's DeepSeek path ignores) are refused
    (:mod:`fqr.rope_cache` says how the two differ).

    ``name`` defaults to the config's checkpoint name, lower case (``Qwen/Qwen3-8B`` ->
    ``qwen3-8b``), else its model type.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if isinstance(model_type, str) and model_type in HF_VARIANT_FAMILIES:
        raise ValueError(
            f"config: {model_type}: {HF_VARIANT_FAMILIES[model_type]}; presets of the "
            f"prologue's variants are not built from a config yet"
        )
    if family is None:
        needs = HF_NEEDS.get(model_type) if isinstance(model_type, str) else None
        raise ValueError(
            f"config: model_type {model_type!r} is not a family fqr builds presets for: "
            + (
                f"it needs {needs}"
                if needs
                else "its attention is not checked against fqr's ops (tests/core/test_hf_zoo.py)"
            )
        )
    rope, origin = _rope_parameters(text)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in family.scalings:
        raise ValueError(
            f"config: RoPE scaling {rope_type!r} ({model_type}) is not one fqr builds; "
            f"supported: {', '.join(family.scalings)}"
        )
    missing = [k for k in ("rope_theta", *HF_ROPE_SCALINGS[rope_type]) if rope.get(k) is None]
    if missing:
        raise ValueError(f"config: RoPE ({rope_type}) has no {', '.join(missing)}")
    theta = positive_number(origin["rope_theta"], rope["rope_theta"])
    scaling = _scaling(rope, origin, rope_type, model_type)
    variant_params: tuple = ()
    if family.variant == "mla-kv":
        heads = positive_count(
            "config.num_attention_heads", _required(text, "num_attention_heads", model_type)
        )
        head_dim = getattr(text, "qk_rope_head_dim", None)
        if head_dim is None:
            raise ValueError(f"config: {model_type} (MLA) has no qk_rope_head_dim")
        kv_heads, head_dim = 1, positive_count("config.qk_rope_head_dim", head_dim)
        head_key, partial_rotary_factor, factor_key = "config.qk_rope_head_dim", 1.0, None
        variant_params = _mla_variant_params(text, model_type, family)
    else:
        heads, kv_heads, head_dim, head_key = _head_counts(text, model_type)
        partial_rotary_factor, factor_key = 1.0, None
        if rope.get("partial_rotary_factor") is not None:
            factor_key = origin["partial_rotary_factor"]
            partial_rotary_factor = fraction(factor_key, rope["partial_rotary_factor"])
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:  # RoPE rotates pairs
        raise ValueError(
            f"{factor_key} {partial_rotary_factor!r} rotates {rotary_dim} of head_dim "
            f"{head_dim} features: the rotated part must be even and >= 2"
            if factor_key
            else f"{head_key} ({head_dim}) must be even: RoPE rotates the head in pairs"
        )
    if family.variant in MROPE_VARIANTS:
        variant_params = _mrope_params(rope, origin, model_type, rotary_dim, family)
    for key in family.required:
        _required(text, key, model_type)
    for key, harmless, what in family.refused_keys:
        value = getattr(text, key, harmless)
        if value != harmless:
            raise ValueError(
                f"config.{key} {value!r} ({model_type}): the model's attention then has {what}, "
                f"which fqr builds no preset for"
            )
    norm = _norm_kind(text, model_type, family)
    eps = _eps(text, model_type, family, norm)
    max_position = positive_count(
        "config.max_position_embeddings",
        _required(text, "max_position_embeddings", model_type),
    )
    checkpoint = str(getattr(config, "name_or_path", "") or "")
    return Preset(
        name=name or (checkpoint.rstrip("/").rsplit("/", 1)[-1].lower() or model_type),
        hf_id=checkpoint,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        max_position=max_position,
        norm=norm,
        eps=eps,
        weight_offset=family.weight_offset,
        partial_rotary_factor=partial_rotary_factor,
        is_neox=_is_neox(text, family),
        rope_scaling=scaling,
        variant=family.variant,
        variant_params=variant_params,
        hidden_size=_hidden_size(text),
    )
