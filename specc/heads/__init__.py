"""Draft heads: small modules that turn the target's hidden states into draft logits (exit.py: the
early-exit head and its trained adapter)."""
