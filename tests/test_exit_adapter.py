"""train-exit-head end to end on a tiny model: the adapter trains, round-trips through its file,
is compiled into the early-exit draft graph, and speculation with it stays lossless."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specc
from specc.errors import ModelError
from specc.heads.exit import load_adapter, save_adapter
from specc.runtime.kv_cache import KVCache
from specc.training.exit_head import TrainConfig, exit_head, train_exit_head

from conftest import build_bundle


@pytest.fixture(scope="module")
def trained(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    hf = AutoModelForCausalLM.from_pretrained(models_dir / "target").eval()
    tok = AutoTokenizer.from_pretrained(models_dir / "target")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 120)
    cfg = TrainConfig(layer=2, corpus=corpus, train_tokens=2048, eval_tokens=512, seq_len=128, steps=40,
                      batch_tokens=128, lr=5e-3)
    adapter, report = train_exit_head(hf, tok, cfg)
    path = root / "exit2.safetensors"
    save_adapter(path, adapter, 2, report)
    return hf, adapter, report, path


def test_training_improves_agreement_on_held_out_text(trained):
    _, _, report, _ = trained
    assert report["with_adapter"]["expected_sampling_acceptance"] > report["without_adapter"]["expected_sampling_acceptance"]


def test_adapter_file_round_trip_and_checks(trained):
    _, adapter, _, path = trained
    loaded = load_adapter(path, layer=2, hidden=64)
    for name, value in adapter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name])
    with pytest.raises(ModelError, match="trained for layer 2 .* asks for layer 1"):
        load_adapter(path, layer=1, hidden=64)


def test_compiled_draft_applies_the_adapter_and_stays_lossless(trained, models_dir, tmp_path, prompts):
    hf, adapter, _, path = trained
    bundle = build_bundle(tmp_path / "b", models_dir / "target", {"method": "early_exit", "layer": 2, "adapter": str(path)})
    model = specc.load(bundle)
    assert any("with a trained adapter" in note for note in model.bundle.graph("draft").passes)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = exit_head(hf, adapter)(hf(ids, output_hidden_states=True).hidden_states[2][0])
    draft = model.drafter.step
    cache = KVCache(draft.dims, 1, 256)
    logits, _, _ = draft(ids, cache, logit_index=torch.arange(9)[None])
    assert (logits[0] - ref).abs().max() < 1e-3
    fast = model.generate(prompts[:12], max_new_tokens=16)
    slow = model.generate(prompts[:12], max_new_tokens=16, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
