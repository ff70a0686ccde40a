"""The settings of one head-training data set (`DataConfig`), and its cache key."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

CHATS = ("grid", "self")
PROMPTS_VERSION = 4  # part of the data cache key: bump when the prompt lists change (prompt_corpora, self_questions)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DataConfig:
    n_code: int = 96
    n_chat: int = 96
    new_tokens: int = 128
    max_prompt_tokens: int = 192
    top_k: int = 32
    batch: int = 64  # prompts answered at once (decoding reads the weights once a step for all of them)
    seed: int = 0
    source: str = "answers"  # or "text"
    seq_len: int = 256  # text: tokens per window
    dtype: str = "float32"  # the target's passes: float32 or bfloat16 (several times faster on CPUs with AMX)
    code_from: int = 0  # the first code prompt (text: window) used; the ones before belong to earlier sets
    chat_from: int = 0  # the first chat prompt used
    chat: str = "grid"  # chat prompts: "grid" (topic x template) or "self" (user messages the target writes)

    def key(self, model: str) -> str:
        fields = {"model": model, "prompts_version": PROMPTS_VERSION, **asdict(self)}
        # keys of sets cached before these fields existed stay valid
        for name, old in (("dtype", "float32"), ("code_from", 0), ("chat_from", 0), ("chat", "grid")):
            if fields[name] == old:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
