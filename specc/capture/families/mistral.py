"""Mistral: Llama with a sliding window on every layer (when config.sliding_window is set)."""
from .base import Family

FAMILY = Family("mistral", "Mistral", ("mistral",), window="all", notes="sliding window on all layers",
                tiny={"sliding_window": 8})
