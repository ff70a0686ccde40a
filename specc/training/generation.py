"""What the phases that let the target write share: batches of prompts padded on the left for
`model.generate`, and a contiguous LM-head input while it runs."""
from __future__ import annotations

from contextlib import contextmanager

import torch

def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def left_padded(group: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts padded on the left (generate continues them on the right) and its attention mask."""
    width = max(map(len, group))
    return (torch.tensor([[pad] * (width - len(p)) + p for p in group]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group]))


@contextmanager
def contiguous_lm_head(model):
    """While generating: the prompt pass hands the LM head its last positions as a strided view, which torch
    multiplies as a batched matmul over a copy of the weight per row (gigabytes for a large vocabulary);
    a contiguous input avoids it."""
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        hook.remove()
