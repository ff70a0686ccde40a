"""Llama 1/2/3 (incl. Llama 3 rope scaling, which HF's rotary init covers); also SmolLM2."""
from .base import Family

FAMILY = Family(
    "llama", "Llama", ("llama",),
    notes="Llama 3 rope scaling, attention/MLP biases when configured",
    real_checkpoints=("smollm2-135m-instruct",),
)
