"""Hugging Face transformers' attention prologues (Qwen3, Gemma 3) run as the models run them,
with q and k captured where the attention function receives them: the bitwise reference of
``numerics="unfused"`` (tests/core/test_unfused_models.py, tests/gpu/test_unfused_gpu.py)."""

from __future__ import annotations

import torch


def capture_attention():
    """Register an attention implementation that records the q and k it is given."""
    from transformers import AttentionInterface

    seen: dict[str, torch.Tensor] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen["q"], seen["k"] = query, key
        b, _, s, dim = query.shape
        return query.new_zeros(b, s, query.shape[1], dim), None

    AttentionInterface.register("fqr_capture", capture)
    return seen


def hf_attention_case(
    family: str,
    gen: torch.Generator,
    tokens: int,
    device: str = "cpu",
    heads: int = 4,
    kv_heads: int = 2,
    d: int = 64,
):
    """One random bf16 forward of transformers' ``Qwen3Attention`` (``family="qwen3"``),
    ``Gemma3Attention`` (``"gemma3"``) or ``Olmo2Attention`` (``"olmo2"``: full-width norms,
    ``norm="full"``, rounded as ``numerics="unfused-hf"``) on ``device``:
    ``(args, kwargs, hf_q, hf_k)``, fqr's arguments for the same projections packed
    ``[q | k | v]`` (with a table built by the model's rotary module for every position) and
    the q ``[T, Hq*D]`` and k ``[T, Hkv*D]``
    the model hands its attention function."""
    import transformers

    seen = capture_attention()
    hidden, max_pos = 96, 2048
    common = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        intermediate_size=128,
        vocab_size=32,
    )
    if family == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m

        config = transformers.Qwen3Config(**common)
        config._attn_implementation = "fqr_capture"
        attn = m.Qwen3Attention(config, layer_idx=0)
        rotary = m.Qwen3RotaryEmbedding(config)
        layer_args: tuple = ()
        offset = 0.0
    elif family == "olmo2":
        from transformers.models.olmo2 import modeling_olmo2 as m

        config = transformers.Olmo2Config(**common)
        config._attn_implementation = "fqr_capture"
        attn = m.Olmo2Attention(config, layer_idx=0)
        rotary = m.Olmo2RotaryEmbedding(config)
        layer_args = ()
        offset = 0.0
    else:
        from transformers.models.gemma3 import modeling_gemma3 as m

        config = transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=d)
        config._attn_implementation = "fqr_capture"
        attn = m.Gemma3Attention(config, layer_idx=0)
        rotary = m.Gemma3RotaryEmbedding(config)
        layer_args = (config.layer_types[0],)
        offset = 1.0
    attn = attn.to(gen.device)  # filled where the draws are (the GPU; meta in the build run)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) * 0.3)
        centre = 1.0 - offset  # the weights the model stores: w (Qwen3) or w - 1 (Gemma)
        for norm in (attn.q_norm, attn.k_norm):
            n = norm.weight.shape[0]
            norm.weight.copy_(centre + 0.2 * torch.randn(n, generator=gen, device=gen.device))
    attn = attn.to(device=device, dtype=torch.bfloat16)
    rotary = rotary.to(device)

    hidden_states = torch.randn(1, tokens, hidden, generator=gen, device=gen.device) * 2.0
    hidden_states = hidden_states.to(device, torch.bfloat16)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=gen.device).to(device)
    with torch.no_grad():
        cos, sin = rotary(hidden_states, positions[None], *layer_args)
        attn(hidden_states, (cos, sin), None)
        qkv = torch.cat(
            [attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)],
            dim=-1,
        )[0]
        # The model's own rotary module builds fqr's table: every position, fp32 (cast by fqr).
        probe = torch.zeros(1, 1, dtype=torch.float32, device=device)
        cos_all, sin_all = rotary(probe, torch.arange(max_pos, device=device)[None], *layer_args)
        table = torch.cat([cos_all[0, :, : d // 2], sin_all[0, :, : d // 2]], dim=-1)
    hf_q = seen["q"].transpose(1, 2).reshape(tokens, heads * d)
    hf_k = seen["k"].transpose(1, 2).reshape(tokens, kv_heads * d)
    args = (qkv, positions, table, attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
    kwargs = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        eps=1e-6,
        weight_offset=offset,
        numerics="unfused-hf" if family == "olmo2" else "unfused",
        norm="full" if family == "olmo2" else "head",
    )
    return args, kwargs, hf_q, hf_k
