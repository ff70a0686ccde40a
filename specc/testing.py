"""Tiny random Hugging Face models with a byte-level tokenizer, for tests and examples.

    make_tiny_model("/tmp/tiny", arch="llama", seed=0)

writes a model directory that every specc entry point accepts as a model source.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .capture.families import FAMILIES

ARCHS = tuple(FAMILIES)  # one tiny random config per registered model family


def byte_tokenizer():
    """A 257-token byte-level tokenizer: every byte plus <eos> (id 256); any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 260, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, max_positions: int = 4096, **overrides):
    """A tiny config of family `arch` (its `Family.tiny` traits switched on); `overrides` win."""
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}; choose from {ARCHS}")
    family = FAMILIES[arch]
    extra = {**family.tiny, **overrides}
    if "layer_types" in extra:  # a repeating pattern, stretched to the layer count
        pattern = extra["layer_types"]
        extra["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    eos = 256 if vocab_size > 256 else None  # small-vocab models (statistical tests) never stop
    return AutoConfig.for_model(
        family.model_types[0], vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None, pad_token_id=eos, **extra,
    )


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, logit_scale: float = 1.0, **config) -> Path:
    """Write a random model + byte tokenizer to `path`; logit_scale multiplies the LM head
    (peakier distributions for statistical tests)."""
    return _save(tiny_model(arch, seed, logit_scale, **config), path)


def tiny_model(arch: str = "llama", seed: int = 0, logit_scale: float = 1.0, **config):
    """The random model `make_tiny_model` writes, in memory (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # Gemma norms scale by (1 + w), the others by w
                p.normal_(1.0 - FAMILIES[arch].norm_offset, 0.05)
            else:
                p.normal_(0.0, 0.2 if p.dim() > 1 else 0.05)
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model


def derive_draft(target: str | Path, path: str | Path, layers: int | None = None, perturb: float = 0.0,
                 shift_lm_head: int = 0, seed: int = 1) -> Path:
    """A draft made from a target: its first `layers` layers, weights plus perturb x N(0, 1) noise.

    shift_lm_head rolls the LM head rows, so the draft's argmax is the target-like argmax + shift:
    with no other change, a draft whose greedy token is never the target's.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        for per_layer in ("layer_types", "no_rope_layers"):  # per-layer config lists shrink with the layers
            if getattr(model.config, per_layer, None) is not None:
                setattr(model.config, per_layer, getattr(model.config, per_layer)[:layers])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * perturb)
        if shift_lm_head:
            model.lm_head.weight.copy_(torch.roll(model.lm_head.weight, shifts=shift_lm_head, dims=0))
    return _save(model, path)


def _save(model, path: str | Path) -> Path:
    path = Path(path)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path
