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

from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

from .core import lookup
from .ops.split import codegen_shards
from .rope_cache import (
    check_rope,
    fraction,
    positive_count,
    rope_cos_sin_cache,
)
from .validate import (
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
        :func:`fqr.hf.preset_from_hf_config`, the mapping's own module)."""
        from .hf import preset_from_hf_config

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
        shards = codegen_shards(self.params.get("qkv_layout"))
        if shards is not None and shards % tp:  # a rank's slice of the row: whole shards
            raise ValueError(
                f"tp={tp} does not divide {self.name}'s {shards} shards of qkv_layout "
                f"{self.params['qkv_layout']!r}"
            )
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
