"""Building blocks of step graphs shared by every model family (norms, rotary tables, attention,
routed experts). Each wraps the Hugging Face module's own weights; none copies them."""
