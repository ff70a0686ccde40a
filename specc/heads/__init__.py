"""Learned draft heads on the target's hidden features: Medusa and EAGLE.

`modules.py` holds the torch modules (exported as step graphs into bundles), `store.py`
reads and writes them (specc's own layout and the published Medusa and EAGLE layouts),
`train.py` trains them on the CPU from the target's own outputs.
"""
