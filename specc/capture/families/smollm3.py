"""SmolLM3: Llama with rope switched off on every few layers (no_rope_layers)."""
from .base import Family

FAMILY = Family(
    "smollm3", "SmolLM3", ("smollm3",), window="layer_types",
    rope_layers=lambda config: [bool(flag) for flag in config.no_rope_layers],
    notes="layers without rope (NoPE) per no_rope_layers",
    tiny={"no_rope_layer_interval": 2},
)
