"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary, longrope."""
from .base import Family

FAMILY = Family(
    "phi3", "Phi-3 / Phi-4", ("phi3",), fused_qkv=True, window="all",
    notes="fused qkv and gate_up; longrope: long factors from position original_max_position_embeddings on "
          "(HF generate instead re-encodes the whole cache when a sequence crosses it)",
    tiny={"partial_rotary_factor": 0.75, "original_max_position_embeddings": 20,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 20,
                              "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                              "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]}},
)
