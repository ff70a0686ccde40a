"""StarCoder2: LayerNorm with biases, biased projections, GELU MLP (c_fc/c_proj), sliding window."""
from .base import Family

FAMILY = Family("starcoder2", "StarCoder2", ("starcoder2",), window="all",
                notes="LayerNorm (kept as LayerNormalization), biases, GELU MLP",
                tiny={"sliding_window": 8, "use_bias": True})
