"""Qwen2 / Qwen2.5: q/k/v biases (HF projections carry them); optional sliding layers by layer_types."""
from .base import Family

FAMILY = Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), window="layer_types", notes="q/k/v biases",
                real_checkpoints=("qwen2.5-coder-0.5b-instruct",))
