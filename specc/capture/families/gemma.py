"""Gemma: (1 + w) RMSNorms, embeddings scaled by sqrt(hidden) (inside HF's embedding module), GeGLU."""
from .base import Family

FAMILY = Family("gemma", "Gemma", ("gemma",), norm_offset=1.0, notes="(1+w) norms, scaled embeddings",
                tiny={"head_dim": 16})
