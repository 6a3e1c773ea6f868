"""Hugging Face transformers' Qwen3, built from a config with random weights (no download).

:func:`hf_qwen3_model` builds ``transformers.Qwen3ForCausalLM`` (decoder layers with their
MLPs, final norm, ``lm_head``; SDPA attention) from a :class:`Qwen3Shape` on any device, with
the q/k norm weights drawn around 1 (HF initialises them to exactly 1, which would hide a
wrong weight). :class:`LastTokenLogits` is the forward a serving stack runs for a prefill:
every token through the decoder, logits for the last one. transformers is imported on use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Qwen3Shape:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float = 1e6
    eps: float = 1e-6
    max_position: int = 40960


# Qwen3-8B's layer shapes (config.json of Qwen/Qwen3-8B), fqr's preset of that name.
QWEN3_8B_PRESET = "qwen3-8b"
QWEN3_8B = Qwen3Shape(
    hidden=4096, intermediate=12288, num_heads=32, num_kv_heads=8, head_dim=128, vocab=151936
)
# The same structure at test size (CPU).
QWEN3_TINY = Qwen3Shape(
    hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, head_dim=16, vocab=256
)


def transformers_missing() -> str | None:
    """Why the HF model cannot be built here, or None."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    return None


def hf_qwen3_config(shape: Qwen3Shape, layers: int):
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=shape.eps,
        rope_theta=shape.rope_theta,
        max_position_embeddings=shape.max_position,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def hf_qwen3_model(
    shape: Qwen3Shape,
    layers: int,
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
):
    """``Qwen3ForCausalLM`` with ``layers`` decoder layers of ``shape``, random weights."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    reason = transformers_missing()
    if reason:
        raise RuntimeError(reason)
    from transformers import Qwen3ForCausalLM

    config = hf_qwen3_config(shape, layers)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = Qwen3ForCausalLM(config)
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.data = 1.0 + 0.1 * torch.randn_like(norm.weight)
    return model.to(dtype).eval()


class LastTokenLogits(nn.Module):
    """Decoder over every token, then ``lm_head`` on the last one (a prefill's logits):
    returns ``(final hidden states [1, T, hidden], logits [1, vocab])``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        out = self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state
        return hidden, self.model.lm_head(hidden[:, -1])
