"""Upper bounds of the speculation shape, shared by the recipe schema, the compiled graphs' shape
ranges and the runtime's request checks (one definition; the recipe's help text shows them)."""

MAX_K = 16  # chain drafts per round
AUTO_K_MAX = 8  # k "auto" considers k up to max(the recipe's k, this)
MAX_TREE_DEPTH = 16  # levels of a token tree
MAX_TREE_BRANCHING = 8  # children per node of a dynamic tree
MAX_TREE_NODES = 128  # drafted nodes verified in one target pass
MAX_TREE_CHILD_INDEX = 63  # largest child index in a static tree path
MAX_NGRAM = 16  # longest n-gram prompt lookup matches
MAX_LOOKAHEAD_WINDOW = 16  # lanes of lookahead decoding's window (W)
MAX_LOOKAHEAD_NGRAM = 8  # tokens of its n-grams (N)
MAX_LOOKAHEAD_VERIFY = 16  # n-grams of its verification branch (G)


def lookahead_nodes(window: int, ngram: int, verify_ngrams: int) -> int:
    """Most drafted nodes of a lookahead round: the window's W (N - 1) tokens but the pending one, and G
    n-grams of N - 1 tokens (TensorRT-LLM's maxDraftLen)."""
    return (window + verify_ngrams) * (ngram - 1) - 1


def auto_k_max(k: int | str) -> int:
    """The largest k adaptive speculation considers for a recipe's speculation.k (an integer or "auto")."""
    return AUTO_K_MAX if k == "auto" else min(max(k, AUTO_K_MAX), MAX_K)


def is_probability(x: object) -> bool:
    """A number (not a bool) in [0, 1]: what a stop_below threshold must be, wherever it is given."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float32") -> int:
    """Bytes of keys and values one token takes in a row's KV cache."""
    return 2 * n_layers * n_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def context_cost(per_token: int, max_context: int, max_batch: int | None = None) -> str:
    """What contexts cost in KV memory, in words (inspect, models check)."""
    mib = 1 << 20
    text = (f"KV cache {per_token / 1024:.1f} KiB per token per row: 2k tokens {2048 * per_token / mib:.0f} MiB, "
            f"{max_context} tokens {max_context * per_token / mib:.0f} MiB")
    if max_batch:
        text += f", x {max_batch} rows {max_batch * max_context * per_token / mib / 1024:.2f} GiB"
    return text + " (the cache grows with the rows' contexts; only what they hold is allocated)"
