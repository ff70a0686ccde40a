"""The step graph equals the Hugging Face model, whole-sequence and incrementally with a cache."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specc.capture.step_decoder import StepDecoder
from specc.errors import ModelError
from specc.testing import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma"])
def test_step_decoder_matches_hf(arch, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / arch, arch=arch)).eval()
    dec = StepDecoder(hf).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        L, H, D = dec.n_layers, dec.n_kv_heads, dec.head_dim
        k = torch.zeros(L, 2, H, 16, D)
        v = torch.zeros_like(k)
        lens = torch.zeros(2, dtype=torch.long)
        # prefill 7 tokens, then 3 + 2: positions and cache lengths carry across calls
        for lo, hi in ((0, 7), (7, 10), (10, 12)):
            t = hi - lo
            pos = torch.arange(lo, hi).expand(2, t)
            logits, nk, nv = dec(ids[:, lo:hi], pos, lens, torch.arange(t).expand(2, t), k, v)
            assert (logits - ref[:, lo:hi]).abs().max() < 1e-4
            k[:, :, :, lo:hi], v[:, :, :, lo:hi] = nk, nv
            lens = lens + t


def test_rows_with_different_cache_lengths(tmp_path):
    """Row 1 has 3 stale slots past its length: they must be masked out."""
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).eval()
    dec = StepDecoder(hf).eval()
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
        L, H, D = dec.n_layers, dec.n_kv_heads, dec.head_dim
        k = torch.randn(L, 2, H, 12, D)
        v = torch.randn(L, 2, H, 12, D)
        _, nk, nv = dec(ids[:, :8], torch.arange(8)[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                        k[:, :1] * 0, v[:, :1] * 0)
        k[:, 1, :, :8], v[:, 1, :, :8] = nk[:, 0], nv[:, 0]
        lens = torch.tensor([3, 8])
        logits, _, _ = dec(ids[:, 8:].expand(2, 1), lens[:, None], lens, torch.zeros(2, 1, dtype=torch.long), k, v)
    assert (logits[1, 0] - ref).abs().max() < 1e-4


def test_logit_index_selects_positions(tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).eval()
    dec = StepDecoder(hf).eval()
    ids = torch.randint(0, 256, (2, 6))
    L, H, D = dec.n_layers, dec.n_kv_heads, dec.head_dim
    empty = torch.zeros(L, 2, H, 0, D)
    with torch.no_grad():
        full, _, _ = dec(ids, torch.arange(6).expand(2, 6), torch.zeros(2, dtype=torch.long), torch.arange(6).expand(2, 6),
                         empty, empty)
        picked, _, _ = dec(ids, torch.arange(6).expand(2, 6), torch.zeros(2, dtype=torch.long), torch.tensor([[5], [2]]),
                           empty, empty)
    assert torch.allclose(picked[0, 0], full[0, 5], atol=1e-5) and torch.allclose(picked[1, 0], full[1, 2], atol=1e-5)


def test_unsupported_architecture_is_named(tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).eval()
    hf.config.model_type = "gpt2"
    with pytest.raises(ModelError, match="'gpt2' cannot be compiled: unsupported position encoding"):
        StepDecoder(hf)
    hf.config.model_type = "bert"
    with pytest.raises(ModelError, match="unknown model_type 'bert'; supported: llama, mistral"):
        StepDecoder(hf)
