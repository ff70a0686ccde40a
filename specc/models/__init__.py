"""Model sources: the offline catalog, local Hugging Face directories and GGUF files."""
