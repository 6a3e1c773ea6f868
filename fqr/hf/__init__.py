"""The Hugging Face mapping: a :class:`fqr.presets.Preset` from a transformers config.

Two files: :mod:`fqr.hf.families` holds the families as data (:data:`HF_FAMILIES`, one
:class:`HFFamily` per ``model_type`` fqr builds; :data:`HF_NEEDS`, the line each refused type
is refused with), :mod:`fqr.hf.config` the readers of a config's keys and
:func:`preset_from_hf_config` (``Preset.from_hf_config`` calls it). Layer 4, beside the presets
(ARCHITECTURE.md): it imports the presets, the RoPE tables and the checks, nothing above.
"""

from .config import (
    HF_ROPE_DEFAULTS,
    HF_ROPE_EXTRAS,
    HF_ROPE_SCALINGS,
    UnsupportedConfig,
    norm_weights,
    preset_from_hf_config,
)
from .families import HF_FAMILIES, HF_NEEDS, HF_VARIANT_FAMILIES, MROPE_VARIANTS, HFFamily

__all__ = [
    "HF_FAMILIES",
    "HF_NEEDS",
    "HF_ROPE_DEFAULTS",
    "HF_ROPE_EXTRAS",
    "HF_ROPE_SCALINGS",
    "HF_VARIANT_FAMILIES",
    "MROPE_VARIANTS",
    "HFFamily",
    "UnsupportedConfig",
    "norm_weights",
    "preset_from_hf_config",
]
