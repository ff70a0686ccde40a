"""Triton Inference Server model repositories from a bundle (`specc triton`); see docs/triton.md.

    from specc.triton import write_repository
    write_repository("bundles/quickstart", "triton-repo", name="specc", layout="in-process")
"""
from .repository import ENGINES, LAYOUTS, write_repository

__all__ = ["ENGINES", "LAYOUTS", "write_repository"]
