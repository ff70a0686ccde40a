"""Qwen3: per-head RMSNorm on queries and keys before rope."""
from .base import Family

FAMILY = Family("qwen3", "Qwen3", ("qwen3",), qk_norm="head", window="layer_types", notes="qk-norm",
                tiny={"head_dim": 16})
