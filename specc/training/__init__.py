"""Training draft heads on the target's own outputs (exit_head.py: `specc train-exit-head`)."""
