"""The transformers model families fqr builds presets for, as data: one :class:`HFFamily` per
``model_type`` (:data:`HF_FAMILIES`: what the family's attention code does that its config does
not say), and one line per model type fqr refuses (:data:`HF_NEEDS`: what fqr lacks for it).

Adding a family whose prologue fqr has is one line here (a new :class:`HFFamily`, or its
model type in :data:`_SAME_PROLOGUE` under the family it runs like); its config is read by
:func:`fqr.hf.config.preset_from_hf_config`, and ``tests/core/test_hf_zoo.py`` holds it to the
model's own attention bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    # The config key of the QK norms' eps (LFM2: norm_eps; Persimmon: layer_norm_eps); None:
    # the family's code reads none (no QK norm), or uses :attr:`fixed_eps` whatever it says
    eps_key: str | None = "rms_norm_eps"
    # The variant's fields the family's code fixes (a packed row's qkv_layout, a norm's
    # weights), whatever its config says
    variant_params: tuple[tuple[str, object], ...] = ()
    # NTK-alpha RoPE (Hunyuan): a ``dynamic`` scaling with an ``alpha`` is the default table of
    # the base ``rope_theta * alpha ** (D / (D - 2))`` (the code's compute_ntk_alpha_rope_...)
    ntk_alpha: bool = False
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
    # DeepSeek's q_a_layernorm / kv_a_layernorm with its 1e-6 default and reads no key for
    # them; vLLM passes rms_norm_eps, so a config whose rms_norm_eps is not 1e-6, GLM-4.7-Flash's
    # and GLM-5's 1e-5, runs another eps in vLLM): the preset takes the model code's
    fixed_eps: float | None = None
    # The config key of the kv head count the family's code reads (``num_attention_heads``:
    # multi-head attention, as GPT-J's code reads no other); None: one kv head whatever
    # the config says (Falcon's ``multi_query`` row: ``[q | k | v]`` with one k and one v head)
    kv_heads_key: str | None = "num_key_value_heads"
    # RoPE the family's code fixes whatever the config says: its base (GPT-J / CodeGen's
    # ``create_sinusoidal_positions``: 10000, no RoPE key read), and the config key of the
    # features of each head it rotates (``rotary_dim``; None: partial_rotary_factor)
    fixed_theta: float | None = None
    rotary_dim_key: str | None = None
    # The family's yarn is Hugging Face's (vLLM's generic YaRNScalingRotaryEmbedding: gpt-oss),
    # which reads ``truncate``; else vLLM's DeepSeek yarn, which ignores it (false is refused)
    yarn_truncate: bool = False
    # The family's rotary embedding returns cos / sin in the model dtype (``cos.to(x.dtype)``)
    # and its RoPE multiplies them with the fp32 q and k, rounded once (Cohere's ``q.float()``):
    # fqr's ``fused`` arithmetic given the table in the model dtype
    # (``preset.cos_sin_cache(dtype=...)``, the dtype vLLM's rotary embedding casts it to)
    table_in_model_dtype: bool = False
    # The family's RoPE rotates by the negated angle (nanochat's ``rotate_half`` is
    # ``cat(x2, -x1)``): the usual rotation by the table of the negated positions (the preset's
    # scaling ``negated``, built from a ``default`` one)
    negated_angle: bool = False
    # The family's per-head QK norm has no weight (Muse's qk_norm, ``with_scale=False``), and
    # its q is multiplied after the norm by the config value of this key (Muse's
    # ``qk_scale_factor``, a Python float: the bf16 product computed in fp32, rounded once):
    # fqr's op takes ones as k's weight and that value as q's, in fp32
    # (:func:`fqr.hf.config.norm_weights`); None: the model's own norm weights
    weightless_norm: bool = False
    q_scale_key: str | None = None
    # The layer type (in ``config.layer_types``) whose layers run MiniMax-M3's lightning
    # indexer beside the attention: a config that has such layers builds the preset of those
    # layers, the ``index-heads`` variant (its index heads read from the config); one without
    # them the family's own
    indexer_layer_type: str | None = None
    # The layer type (in ``config.layer_types``) whose layers the preset describes: its RoPE
    # settings (``rope_parameters[layer_type]``) and, where the config is per layer
    # (``per_layer_config``: Gemma 4), the sizes of its first layer of that type; None: the
    # ``full_attention`` RoPE settings where the config has them per layer type, the global sizes
    layer_type: str | None = None


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
    # its talker (Qwen3OmniMoeTalkerDecoderLayer): the thinker's attention and rotary embedding
    "qwen3_omni_moe_talker_text": HFFamily(**_QWEN3_VL, note="Qwen3-Omni talker: as its thinker"),
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
# Qwen4-Exp's indexed-attention layers: Qwen3.5's attention (its rotary embedding always
# interleaves, default [11, 11, 10]); its indexer is not this prologue
HF_FAMILIES["qwen4_exp_text"] = HFFamily(
    **_QWEN3_5, note="Qwen4-Exp: as Qwen3.5, its indexer aside"
)
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
        # transformers runs these with Llama's code (config-only types) or its copy
        "deepseek_ocr2_text", "emu3_text_model", "exaone", "internlm3", "iquestcoder",
        "mllama_text_model",
        # Moshi's temporal transformer (its MoshiLinear projections); Voxtral Realtime's text
        # decoder (VoxtralRealtimeTextAttention: no QK norm)
        "moshi", "voxtral_realtime_text",
        # Kyutai's speech-to-text decoder: Moshi's attention (its projections per codebook)
        "kyutai_speech_to_text",
        # IDEFICS's decoder self-attention (its gated cross-attention layers rotate nothing;
        # multi-head: no num_key_value_heads)
        "idefics",
    ),
    "glm": ("helium",),
    # Step 3.7's text model (model_type step3p5): Gemma 3's (1 + w) per-head norms and NeoX
    # halves, its full-attention layers' heads (num_attention_heads; the sliding ones take
    # num_sliding_attention_heads) and RoPE (rope_parameters['full_attention']); T5Gemma 2's
    # encoder self-attention (t5gemma2_text) and its decoder's merged attention (its
    # self-attention part; the cross-attention's k and v are not rotated): Gemma 3's
    "gemma3_text": ("step3p5", "t5gemma2_text", "t5gemma2_decoder"),
    "qwen3": (
        "apertus", "apertus1p5_text", "doge", "dots1", "exaone4", "exaone_moe", "hy_v3",
        "kolibri1", "laguna", "mellum", "sarvam_moe",
    ),
    "olmo2": ("flex_olmo", "olmo_hybrid"),
    "deepseek_v3": ("axk1", "youtu", "sarvam_mla"),
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
# Zamba2's shared attention (Zamba2Attention): as Llama, head_dim attention_head_dim (its
# attribute map's head_dim), RoPE only with use_mem_rope (default False: no RoPE, no prologue
# of fqr's); its LoRA adapters (use_shared_attention_adapter) add to the projection's output,
# the row the op reads
HF_FAMILIES["zamba2"] = HFFamily(
    "none",
    refused_keys=(("use_mem_rope", True, "no RoPE"),),
    note="Zamba2: as Llama with use_mem_rope",
)
# Families whose prologue is a variant (fqr.prologue), not the split-qkv op: why.
# (none now: Gemma 4's and MiniMax-M3's variants have builders)
HF_VARIANT_FAMILIES: dict[str, str] = {}
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
# Cohere Compass (North): no QK norm, its rotary embedding always interleaves the sections
# (recomposition_frequencies, default [24, 20, 20]; mrope_interleaved never read), its RoPE per
# layer type (the full_attention layers')
HF_FAMILIES["cohere_compass_text"] = replace(
    HF_FAMILIES["cosmos3_edge_text"], eps_key=None, note="Cohere Compass: qk-mrope, interleaved"
)
# GLM-4V and GLM-OCR rotate GPT-J pairs (rotate_half_llm)
HF_FAMILIES |= {
    model_type: HFFamily(
        **_QWEN2_VL, is_neox=False, mrope_section=(8, 12, 12), note=f"{model_type}: qk-mrope"
    )
    for model_type in ("glm4v_text", "glm_ocr_text")
}
# Per-head QK norms that multiply the weight in fp32 and round once (``(self.weight *
# hidden_states).to(input_dtype)``, where Qwen3's rounds before the weight), then RoPE as
# Llama's (cos / sin in the model dtype): "unfused-hf" (fqr.numerics); their RoPE layers
HF_FAMILIES |= {
    t: HFFamily("head", numerics="unfused-hf", note=f"{t}: per-head norms, the weight in fp32")
    for t in ("afmoe", "flint", "lara_mini")
}
HF_FAMILIES |= {
    "lfm2": HFFamily("head", eps_key="norm_eps", note="LFM2: per-head QK norms (norm_eps)"),
    "lfm2_moe": HFFamily("head", eps_key="norm_eps", note="LFM2-MoE: as LFM2"),
    "olmo3": replace(HF_FAMILIES["olmo2"], note="OLMo 3: as OLMo 2, the full-attention layers"),
}

# The packed row as the checkpoint stores it (split-qkv-layout: GPTNeoXAttention's and
# GPTNeoXJapaneseAttention's query_key_value viewed [T, H, 3 * D], each head's q | k | v; no
# QK norm; NeoX halves rotated in the model dtype); Persimmon's per-head row with a LayerNorm
# (nn.LayerNorm(head_dim), weight and bias, eps layer_norm_eps) on q and k (qk-layernorm); and
# Hunyuan's weighted per-head RMSNorm after RoPE (rope-rmsnorm: query_layernorm /
# key_layernorm, always built; its "dynamic" RoPE with an alpha is NTK-alpha)
_PER_HEAD_ROW = (("qkv_layout", "per-head"),)
HF_FAMILIES |= {
    t: HFFamily(
        "none",
        variant="split-qkv-layout",
        variant_params=_PER_HEAD_ROW,
        eps_key=None,
        note=f"{t}: its fused qkv read per head as stored, no QK norm",
    )
    for t in ("gpt_neox", "gpt_neox_japanese")
}
HF_FAMILIES["persimmon"] = HFFamily(
    "none",
    variant="qk-layernorm",
    variant_params=(*_PER_HEAD_ROW, ("norm_weights", "shared")),
    eps_key="layer_norm_eps",
    refused_keys=(("qk_layernorm", True, "no LayerNorm on q and k"),),
    note="Persimmon: its per-head row, LayerNorm on q and k, partial rotary",
)
HF_FAMILIES |= {
    t: HFFamily(
        "head",
        variant="rope-rmsnorm",
        scalings=("default", "dynamic"),
        ntk_alpha=True,
        note=f"{t}: RoPE, then a weighted per-head RMSNorm",
    )
    for t in ("hunyuan_v1_dense", "hunyuan_v1_moe")
}

# nanochat (NanoChatAttention): NeoX halves rotated by the negated angle (its rotate_half is
# cat(x2, -x1): the usual rotation by the table of the negated positions, exactly, as sin is
# odd), rounded as Llama's, then a weightless RMSNorm of each head (q_norm / k_norm: fp32,
# rounded once), eps rms_norm_eps: the rope-l2norm variant, vLLM's rounding
HF_FAMILIES["nanochat"] = HFFamily(
    "none",
    variant="rope-l2norm",
    scalings=("default",),
    negated_angle=True,
    note="nanochat: RoPE by the negated angle, then a weightless norm",
)

# Muse Glimmer / Spark text models (their TextAttention): one weightless per-head RMSNorm of q
# and of k (fp32, torch.pow(ms, -0.5), which is rsqrt, rounded once), q then multiplied by
# qk_scale_factor in the model dtype (bf16(bf16(n) * s), s in fp32), then RoPE as Llama's; their
# RoPE layers (layer_rope_theta non-zero; the rest are NoPE). fqr's per-head norm with the
# weights norm_weights gives (ones for k, qk_scale_factor for q, in fp32), rounded as Qwen3's
HF_FAMILIES |= {
    t: HFFamily(
        "head",
        weightless_norm=True,
        q_scale_key="qk_scale_factor",
        note=f"{t}: weightless per-head norms, q times qk_scale_factor (fqr.hf.norm_weights)",
    )
    for t in ("muse_glimmer_text", "muse_spark_text")
}

# MiniMax-M3 (MiniMaxM3VLAttention): Gemma 3's (1 + w) per-head norms (the weight in fp32, as
# Gemma3RMSNorm), RoPE over partial_rotary_factor of each head (its rotary embedding reads no
# rotary_dim); its minimax_m3_sparse layers also run the lightning indexer (MiniMaxM3VLIndexer:
# index_n_heads q heads and one k head of index_head_dim, (1 + w) norms, the same table): the
# index-heads variant, their q / k / v and the indexer's projections read as one row
HF_FAMILIES["minimax_m3_vl_text"] = HFFamily(
    "head",
    1.0,
    indexer_layer_type="minimax_m3_sparse",
    note="MiniMax-M3: (1 + w) norms; its sparse layers with the indexer heads (index-heads)",
)

# Gemma 3n (Gemma3nTextAttention): per-head q_norm / k_norm that multiply the weight in fp32
# before their one rounding (Gemma3nRMSNorm, no offset), v normalised per head without weight
# (v_norm), RoPE as Llama's on q and k: the split-qkv-vnorm variant under unfused-hf; the
# full-attention layers (rope_parameters['full_attention']); its kv-shared layers reuse an
# earlier layer's k and v (their prologue is q's alone)
HF_FAMILIES["gemma3n_text"] = HFFamily(
    "head",
    variant="split-qkv-vnorm",
    numerics="unfused-hf",
    note="Gemma 3n: per-head norms (the weight in fp32), v normalised too, full layers",
)

# Gemma 4 (Gemma4TextAttention): as Gemma 3n (the weight in fp32, v normalised); its sliding
# layers, sizes from per_layer_config (head_dim, num_key_value_heads), RoPE from
# rope_parameters['sliding_attention']; its full layers (global_head_dim, k = v with
# attention_k_eq_v, a proportional RoPE) are not this preset
HF_FAMILIES |= {
    t: replace(
        HF_FAMILIES["gemma3n_text"],
        layer_type="sliding_attention",
        note=f"{t}: as Gemma 3n, its sliding layers (sizes per layer)",
    )
    # Gemma4UnifiedTextAttention: the same code; EmbeddingGemma2Attention normalises q, k, v
    # first, then rotates q and k (the same prologue); DiffusionGemma's encoder and decoder
    # attention: Gemma 4's without its kv sharing
    for t in ("gemma4_text", "gemma4_unified_text", "embedding_gemma2_text", "diffusion_gemma_text")
}

# Falcon (FalconAttention): with ``multi_query`` (its default) the fused query_key_value is
# ``[q | k | v]`` with one k and one v head whatever num_kv_heads says (the code's
# ``num_kv_heads = 1``); RoPE as Llama's unless ``alibi``. Its other rows are refused:
# ``multi_query`` false interleaves q, k, v per head, ``new_decoder_architecture`` per kv group.
HF_FAMILIES["falcon"] = HFFamily(
    "none",
    kv_heads_key=None,
    refused_keys=(
        ("alibi", False, "ALiBi in place of RoPE"),
        ("new_decoder_architecture", False, "its fused row interleaved per kv group"),
        ("multi_query", True, "its fused row interleaved per head (q, k, v of each)"),
    ),
    note="Falcon (multi_query): one k and one v head, as Llama",
)
# GPT-J and CodeGen: head_dim hidden_size / num_attention_heads, one kv head per q head, the
# first rotary_dim features of each head rotated in GPT-J pairs by a table of the fixed base
# 10000 (create_sinusoidal_positions); no QK norm. GPT-J's table is cast to the model dtype
# (Llama's rounding); CodeGen's stays fp32 and rotates in fp32, rounded once (``fused``), its
# qkv_proj kept as the four model-parallel shards it was trained with (``mp_num = 4``)
_SINUSOIDAL = dict(is_neox=False, eps_key=None, fixed_theta=10000.0, rotary_dim_key="rotary_dim")
HF_FAMILIES["gptj"] = HFFamily(
    "none",
    kv_heads_key="num_attention_heads",
    **_SINUSOIDAL,
    note="GPT-J: GPT-J pairs over rotary_dim",
)
HF_FAMILIES["codegen"] = HFFamily(
    "none",
    kv_heads_key="num_attention_heads",
    **_SINUSOIDAL,
    variant="split-qkv-layout",
    variant_params=(("qkv_layout", "codegen-mp4"),),
    numerics="fused",
    note="CodeGen: its four [q | v | k] shards as stored, GPT-J pairs in fp32",
)

# gpt-oss (GptOssAttention): no QK norm, NeoX halves rounded as Llama's, HF's yarn (truncate
# false; no mscale keys: the multiplier g(s, 1), as fqr's yarn with its defaults); its sinks
# are after the prologue
HF_FAMILIES["gpt_oss"] = HFFamily(
    "none",
    scalings=("default", "yarn"),
    yarn_truncate=True,
    note="gpt-oss: as Llama, yarn (truncate false)",
)

# Chameleon (ChameleonAttention): q_proj, k_proj, v_proj back to back, a LayerNorm over each
# head with that head's own weight and bias (ChameleonLayerNorm: F.layer_norm at its fixed eps
# 1e-5, then * weight + bias), then RoPE as Llama's
HF_FAMILIES["chameleon"] = HFFamily(
    "none",
    variant="qk-layernorm",
    variant_params=(("qkv_layout", "qkv"), ("norm_weights", "per-head")),
    eps_key=None,
    fixed_eps=1e-5,
    note="Chameleon: a LayerNorm on each head with its own weight and bias",
)

# Cohere (CohereAttention) and its kin: no QK norm (Cohere's use_qk_norm LayerNorm is refused),
# GPT-J pairs (the table repeat_interleave'd, rotate_half of pairs), RoPE in fp32 from the
# model-dtype cos / sin, rounded once (table_in_model_dtype); Cohere 2 rotates on its sliding
# layers only. ModernBERT's decoder: the same arithmetic on NeoX halves
_MODEL_DTYPE_TABLE = dict(eps_key=None, numerics="fused", table_in_model_dtype=True)
_COHERE_NOTE = "GPT-J pairs in fp32 from the table in the model dtype"
HF_FAMILIES["cohere"] = HFFamily(
    "none",
    is_neox=False,
    **_MODEL_DTYPE_TABLE,
    refused_keys=(("use_qk_norm", False, "a LayerNorm on q and k (each head its own weight)"),),
    note=f"Cohere: {_COHERE_NOTE}",
)
HF_FAMILIES |= {
    t: HFFamily("none", is_neox=False, **_MODEL_DTYPE_TABLE, note=f"{t}: {_COHERE_NOTE}")
    for t in ("cohere2", "cohere2_moe")
}
HF_FAMILIES["evolla"] = HFFamily(
    "none", **_MODEL_DTYPE_TABLE, note="Evolla: RoPE in fp32 from the table in the model dtype"
)
HF_FAMILIES["modernbert-decoder"] = HFFamily(
    "none",
    **_MODEL_DTYPE_TABLE,
    note="ModernBERT decoder: RoPE in fp32 from the table in the model dtype, global layers",
)

# Families fqr builds no preset for, with what their attention prologue needs (read from their
# transformers modeling code; the zoo test prints each refusal).
_NEEDS = {
    "an MLA variant (latent scaling)": ("longcat_flash", "dots3_note", "dots3_note_text"),
    "an MLA variant (q temperature)": ("mistral_large4_text",),
    "an MLA variant (a gate fused with q)": ("axk2",),
    "an MLA variant with mRoPE": ("hy_v4_vl_text",),
    "a 3-D RoPE (its own position layout)": ("ernie4_5_vl_moe_text",),
    "xdrope (its own position layout)": ("hunyuan_vl_text",),
    "q, k and v clamped to +-attn_config.clip_qkv after the projection (no fqr form; "
    "transformers' DbrxAttention runs only with clip_qkv set)": ("dbrx",),
    "its own attention prologue (no fqr form yet)": ("deepseek_v4", "dory", "jetmoe", "zaya"),
    "q scaled by position after RoPE (rope_parameters' llama_4_scaling_beta: q times 1 + beta "
    "* log(1 + floor(position / original_max_position_embeddings)), in the model dtype), "
    "which no fqr op applies after RoPE": ("ministral3",),
    # measured by the zoo (tests/core/test_hf_zoo.py) on its tiny configs
    "a numerics mode: per-head QK norms that multiply the weight in fp32 before one rounding, "
    "then RoPE in fp32 from fp32 cos / sin, rounded once (unfused-hf rotates as Llama's there; "
    "nearest: unfused-hf, OLMo 2's rounding on per-head norms)": ("beam",),
    "Hugging Face's yarn table and a q scale by position (llama_4_scaling_beta), in MLA": (
        "mistral4",
    ),
    "v scaled by attention_value_scale after its projection (0.707 by default; no fqr op "
    "scales v), and v heads of their own width (v_head_dim 128 beside head_dim 192), which the "
    "split op takes (v_head_dim) but no preset variant carries": ("mimo_v2_flash",),
    "proportional RoPE from a config and a numerics mode: per-head norms rounded as Llama's, "
    "RoPE in fp32 rounded once (nearest: unfused, up to 1.6e-2 absolute)": ("lfm3",),
    "RoPE in its attention first: apply_rotary_pos_emb is defined there but never called (no "
    "rotary prologue to build)": ("jamba", "nemotron_h"),
    "a RoPE table length: its config has no max_position_embeddings (its rotary embedding "
    "takes any position)": ("recurrent_gemma",),
    "a preset builder for its fixed sinusoidal table (base 10000, no rope_theta; "
    "RoFormerSinusoidalPositionalEmbedding)": ("roformer",),
    # what stops the zoo's check (tests/core/test_hf_zoo.py); fqr builds no preset unchecked
    "a check against its model: its config has no num_attention_heads (BLT's own sizes)": (
        "blt",
    ),
    "RoPE in its text attention: only its vision tower rotates (GLM-5-Next's text layers are "
    "NoPE DSA / linear attention, Inkling 2's a relative position bias)": (
        "glm5_next_text", "inkling2_text",
    ),
}  # fmt: skip
HF_NEEDS: dict[str, str] = {t: needs for needs, types in _NEEDS.items() for t in types}
