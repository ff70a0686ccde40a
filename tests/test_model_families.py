"""Every registered model family against Hugging Face on a tiny random config.

Default run (eager, cheap): the step decoder's logits equal HF's incremental decode, and its
batched greedy output (rows of different lengths, generations longer than the sliding windows)
equals `generate` over 8 prompts, for every family and a few config variants. Compiled through
ONNX Runtime with speculation: a few representative families here; every family x drafter x
CPU backend behind `slow` and `heavy` (not in the default run: `pytest -m slow tests/test_model_families.py`).
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import specc
from conftest import build_bundle
from specc.capture.families import FAMILIES, family_for
from specc.capture.step_decoder import StepDecoder
from specc.errors import ModelError
from specc.testing import derive_draft, make_tiny_model, tiny_config, tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# (family, config overrides): every family as registered, plus the variants a family's config switches on
# (variants run with -m heavy: the default run keeps one case per family for the CI budget)
CASES = [(name, {}) for name in FAMILIES] + [pytest.param(*case, marks=pytest.mark.heavy) for case in (
    ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 8}),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}}),
)]
N_NEW = 16


def _case_id(case) -> str:
    name, overrides = case
    return name + ("-" + "-".join(sorted(overrides)) if overrides else "")


def load_hf(path, family: str):
    attn = FAMILIES[family].hf_attention
    return AutoModelForCausalLM.from_pretrained(path, **({"attn_implementation": attn} if attn else {})).eval()


def tiny_hf(family: str, **config):
    """The tiny random model of `family` in memory, on the attention implementation HF compares with."""
    model = tiny_model(family, **config)
    if FAMILIES[family].hf_attention:
        model.set_attn_implementation(FAMILIES[family].hf_attention)
    return model


def prompts_of(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(n)]


@torch.no_grad()
def step_greedy(dec: StepDecoder, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Batched greedy decoding with the eager step graph: rows right-padded to the longest prompt,
    each row's cache advancing from its own length (the runtime's contract, without the runtime)."""
    b, lens = len(prompts), torch.tensor([len(p) for p in prompts])
    t = int(lens.max())
    shape = (dec.n_layers, b, dec.n_kv_heads, t + n_new, dec.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    logits, nk, nv = dec(ids, torch.arange(t).expand(b, t), torch.zeros(b, dtype=torch.long), (lens - 1)[:, None], k, v)
    k[:, :, :, :t], v[:, :, :, :t] = nk, nv
    out = []
    rows = torch.arange(b)
    for _ in range(n_new):
        tok = logits[:, 0].argmax(-1)
        out.append(tok)
        logits, nk, nv = dec(tok[:, None], lens[:, None], lens, torch.zeros(b, 1, dtype=torch.long), k, v)
        k[:, rows, :, lens], v[:, rows, :, lens] = nk[:, :, :, 0].transpose(0, 1), nv[:, :, :, 0].transpose(0, 1)
        lens = lens + 1
    return torch.stack(out, 1).tolist()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                      do_sample=False, eos_token_id=None, pad_token_id=259)
    return out[0, len(prompt):].tolist()


def assert_prefix_until_eos(got: list[int], ref: list[int], eos: int = 256) -> None:
    """The runtime's tokens equal HF's, up to where HF emits EOS (the runtime stops there, without it)."""
    assert got == ref[:len(got)] and (len(got) == len(ref) or ref[len(got)] == eos), (got, ref)


@torch.no_grad()
def hf_incremental_greedy(hf, prompt: list[int], n_new: int) -> list[int]:
    """Greedy decoding with HF's forward and its cache, one token at a time from the first prompt token
    (no generate hooks, every position encoded by a forward whose largest position is its own)."""
    cache, tokens = None, []
    for t in prompt:
        out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    for _ in range(n_new):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def hf_reference(name: str):
    """HF greedy for `name`. Phi-3 longrope: HF picks short or long factors per forward from its largest
    position, and generate re-encodes the whole cache when a sequence crosses
    original_max_position_embeddings; specc picks them per token (so a verify pass does not depend on
    how tokens are grouped), which is HF's forward fed one token at a time."""
    return hf_incremental_greedy if name == "phi3" else hf_greedy


def assert_speculation_matches_hf(model, target, name: str, prompts: list, **speculation) -> None:
    """Speculative greedy output equals target-only, and target-only agrees with Hugging Face greedy."""
    fast = model.generate(prompts, max_new_tokens=N_NEW, **speculation)
    slow = model.generate(prompts, max_new_tokens=N_NEW, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    hf = load_hf(target, name)
    for prompt, c in zip(prompts, slow):
        assert_prefix_until_eos(c.token_ids, hf_reference(name)(hf, prompt, N_NEW))


@pytest.mark.parametrize(("name", "overrides"), CASES, ids=[_case_id(c.values if hasattr(c, "values") else c) for c in CASES])
def test_family_matches_hugging_face(name, overrides):
    hf = tiny_hf(name, layers=3, **overrides)
    dec = StepDecoder(hf).eval()
    assert dec.family == name

    # logits: prefill 9 tokens, then steps of 3, 1 and 11 tokens, against HF's prefill + one-token decode
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids[:, :9], use_cache=True)
        refs, cache = [out.logits], out.past_key_values
        for j in range(9, 24):
            out = hf(ids[:, j:j + 1], past_key_values=cache, use_cache=True)
            refs.append(out.logits)
            cache = out.past_key_values
        ref = torch.cat(refs, 1)
        shape = (dec.n_layers, 2, dec.n_kv_heads, 24, dec.head_dim)
        k, v, lens = torch.zeros(shape), torch.zeros(shape), torch.zeros(2, dtype=torch.long)
        for lo, hi in ((0, 9), (9, 12), (12, 13), (13, 24)):
            t = hi - lo
            logits, nk, nv = dec(ids[:, lo:hi], torch.arange(lo, hi).expand(2, t), lens, torch.arange(t).expand(2, t), k, v)
            torch.testing.assert_close(logits, ref[:, lo:hi], atol=1e-4, rtol=1e-4)
            k[:, :, :, lo:hi], v[:, :, :, lo:hi] = nk, nv
            lens = lens + t

    # greedy: 8 prompts of 2-20 tokens batched together, 16 new tokens (past every window of 8)
    prompts = prompts_of()
    got = step_greedy(dec, prompts, N_NEW)
    bad = [i for i, p in enumerate(prompts) if got[i] != hf_reference(name)(hf, p, N_NEW)]
    assert bad == [], f"{name}: prompts whose greedy output differs from Hugging Face: {bad}"


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_family_compiled_speculation_matches_hugging_face(name, tmp_path):
    """Compiled through ONNX Runtime with a 1-layer draft: speculative == target-only == HF greedy,
    prompts plus output longer than the sliding window (8), rows of different lengths."""
    target = make_tiny_model(tmp_path / "target", arch=name, layers=2)
    draft = derive_draft(target, tmp_path / "draft", layers=1)
    bundle = build_bundle(tmp_path / "bundle", target, {"method": "model", "model": str(draft)},
                          limits={"max_batch": 4, "max_context": 64})
    assert_speculation_matches_hf(specc.load(bundle), target, name, prompts_of(8, seed=1), k=3)


def test_unsupported_configs_are_named():
    cfg = tiny_config("llama")
    cfg.model_type = "mamba2"
    with pytest.raises(ModelError, match="unknown model_type 'mamba2'; supported: llama"):
        family_for(cfg)
    cfg = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelError, match="unsupported rope variant: 'dynamic'"):
        family_for(cfg)
    cfg = tiny_config("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ModelError, match="use_bidirectional_attention"):
        family_for(cfg)


TREE = {"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 8}}


def _drafter(kind: str, target, root) -> tuple[dict, dict]:
    """(draft section, speculation section) of a recipe for drafter `kind`."""
    if kind in ("model", "tree"):
        draft = {"method": "model", "model": str(derive_draft(target, root / "draft", layers=1))}
        return draft, (TREE if kind == "tree" else {"k": 3})
    return {"quantized": {"method": "quantized", "quantize": "int8"},
            "early_exit": {"method": "early_exit", "layer": 1},
            "prompt_lookup": {"method": "prompt_lookup", "max_ngram": 2}}[kind], {"k": 3}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "aoti"])
@pytest.mark.parametrize("drafter", ["model", "tree", "quantized", "early_exit", "prompt_lookup"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_drafter_backend_matrix(name, drafter, backend, tmp_path):
    """Every family x drafter x CPU backend: speculative greedy == target-only greedy, target-only
    == HF greedy (prompts and output past the sliding windows, rows of different lengths)."""
    if drafter == "quantized" and backend != "onnxruntime":
        pytest.skip("quantised drafts are an ONNX Runtime feature")
    target = make_tiny_model(tmp_path / "target", arch=name, layers=2)
    draft, speculation = _drafter(drafter, target, tmp_path)
    bundle = build_bundle(tmp_path / "bundle", target, draft, backend=backend, speculation=speculation,
                          limits={"max_batch": 4, "max_context": 64})
    model = specc.load(bundle, trust_code=True)  # a bundle this test built (aoti loads native code)
    prompts = [p * 2 for p in prompts_of(8, seed=2)]  # repeats give prompt lookup something to find
    assert_speculation_matches_hf(model, target, name, prompts)


def test_models_check_cli(tmp_path, capsys):
    """`specc models check` reads config.json only: the family, or exactly what is missing (exit 2)."""
    import json

    from specc.cli import main
    from specc.capture.check import families_table

    tiny_config("gemma3").save_pretrained(tmp_path / "gemma3")  # a config without weights
    assert main(["models", "check", str(tmp_path / "gemma3")]) == 0
    out = capsys.readouterr().out
    assert "family gemma3" in out and "sliding window 8 on 1 of 2 layers" in out
    (tmp_path / "mla.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 64}))
    assert main(["models", "check", str(tmp_path / "mla.json")]) == 2
    assert "multi-head latent attention" in capsys.readouterr().err
    (tmp_path / "new.json").write_text(json.dumps({"model_type": "brand_new"}))
    assert main(["models", "check", str(tmp_path / "new.json")]) == 2
    assert "unknown model_type 'brand_new'; supported: llama" in capsys.readouterr().err
    assert main(["models", "check", str(tmp_path / "nowhere")]) == 2
    assert all(f"| {f.title} |" in families_table() for f in FAMILIES.values())
