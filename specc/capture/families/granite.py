"""Granite: Llama with embedding, attention, residual and logit multipliers."""
from .base import Family

FAMILY = Family(
    "granite", "Granite", ("granite",), embedding_multiplier="embedding_multiplier",
    residual_multiplier="residual_multiplier", logits_divisor="logits_scaling",
    notes="attention_multiplier is HF's attention scaling",
    tiny={"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 4.0},
)
