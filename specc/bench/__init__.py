"""Measuring specc: `specc bench` (run.py: specc beside its baselines; hf.py: Hugging Face
generate, assisted generation and prompt lookup; report.py: JSON, Markdown and PNG), `specc tune`
(tune.py: the cost model that picks k), and the prompt sets (prompts.py)."""
