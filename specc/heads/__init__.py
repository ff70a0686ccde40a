"""Draft heads: small modules that turn the target's hidden states into draft logits.

exit.py: the early-exit head and its trained adapter; medusa.py and eagle.py: the learned
Medusa heads and EAGLE draft layer (vocab.py: their reduced draft vocabulary); store.py: heads
on disk (specc's layout, published Medusa and EAGLE-1/2 checkpoints).
"""
