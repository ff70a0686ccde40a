"""Draft heads: specc's layout round-trips, published Medusa and EAGLE-1/2 layouts import (synthetic
checkpoints written in those layouts), pickles and EAGLE-3 are refused clearly, train-head trains
and resumes in seconds, the recipe names what is missing."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from heads_helpers import make_random_head, write_eagle3_checkpoint
from specc.errors import ModelError, RecipeError
from specc.heads.store import load_head
from specc.recipe import parse_recipe
from specc.testing import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("t") / "t", seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_specc_layout_round_trips(target, tmp_path, kind):
    path, hf = target
    make_random_head(kind, path, tmp_path / kind)
    a, cfg = load_head(tmp_path / kind, hf)
    b, _ = load_head(tmp_path / kind, hf)
    assert cfg["kind"] == kind and cfg["format"] == "specc-head"
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_reduced_draft_vocabulary_maps_back_with_zero_q_outside(target, tmp_path):
    path, hf = target
    vocab = torch.tensor([1, 5, 7, 200])
    make_random_head("medusa", path, tmp_path / "m", n_heads=2, draft_vocab=vocab)
    head, cfg = load_head(tmp_path / "m", hf)
    assert cfg["draft_vocab_size"] == 4
    logits = head(torch.randn(2, 3, hf.config.hidden_size))
    assert logits.shape == (2, 3, 2, hf.config.vocab_size)
    q = torch.softmax(logits, -1)
    outside = torch.ones(hf.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert q[..., outside].max() == 0 and torch.allclose(q[..., vocab].sum(-1), torch.ones(2, 3, 2))


def test_published_medusa_layout_imports(target, tmp_path):
    path, hf = target
    h, v = hf.config.hidden_size, hf.config.vocab_size
    torch.manual_seed(0)
    tensors = {}
    for i in range(2):
        tensors[f"{i}.0.linear.weight"] = torch.randn(h, h) * 0.1
        tensors[f"{i}.0.linear.bias"] = torch.randn(h) * 0.1
        tensors[f"{i}.1.weight"] = torch.randn(v, h) * 0.1
    d = tmp_path / "medusa-vicuna-7b-v1.3"
    d.mkdir()
    save_file(tensors, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                               "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    head, cfg = load_head(d, hf)
    assert cfg["kind"] == "medusa"
    f = torch.randn(3, h)
    for i in range(2):
        x = f + F.silu(f @ tensors[f"{i}.0.linear.weight"].T + tensors[f"{i}.0.linear.bias"])
        assert torch.allclose(head(f)[:, i], x @ tensors[f"{i}.1.weight"].T, atol=1e-5)


def _eagle_tensors(hf, bias: bool = True) -> dict:
    cfg = hf.config
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (heads * d, h),
              "layers.0.self_attn.k_proj.weight": (kv * d, h), "layers.0.self_attn.v_proj.weight": (kv * d, h),
              "layers.0.self_attn.o_proj.weight": (h, heads * d), "layers.0.post_attention_layernorm.weight": (h,),
              "layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, h), "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, h),
              "layers.0.mlp.down_proj.weight": (h, cfg.intermediate_size), "embed_tokens.weight": (cfg.vocab_size, h)}
    if bias:
        shapes["fc.bias"] = (h,)
    torch.manual_seed(1)
    return {k: torch.randn(s) * 0.1 for k, s in shapes.items()}


def test_published_eagle_layout_imports(target, tmp_path):
    path, hf = target
    tensors = _eagle_tensors(hf)
    d = tmp_path / "EAGLE-tiny"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": hf.config.hidden_size,
                                               "num_hidden_layers": 1, "bias": True}))
    head, cfg = load_head(d, hf)
    assert cfg["kind"] == "eagle"
    state = head.state_dict()
    for k, v in tensors.items():
        if not k.startswith("embed_tokens"):
            assert torch.equal(state[k], v), k
    b, t = 2, 4
    out = head(torch.randint(0, 256, (b, t)), torch.randn(b, t, hf.config.hidden_size), torch.arange(t).expand(b, t),
               torch.zeros(b, dtype=torch.long), torch.full((b, 1), t - 1), head.empty_cache(b), head.empty_cache(b))
    assert out[0].shape == (b, 1, hf.config.vocab_size) and out[1].shape == (b, t, hf.config.hidden_size)


def _eagle3_reference(t: dict, hf, ids, feats, norm_before_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's midlayer written out with plain tensor ops (one sequence, causal, no cache): logits over the
    full vocabulary (d2t-mapped, the float32 minimum elsewhere) and the fed-back hidden state."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    cfg = hf.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d, n = cfg.hidden_size // heads, ids.shape[1]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def proj(x, name, h):
        return (x @ t[f"midlayer.self_attn.{name}.weight"].T).view(1, n, h, d).transpose(1, 2)

    e, hn = rms(hf.model.embed_tokens(ids), t["midlayer.input_layernorm.weight"]), rms(feats, t["midlayer.hidden_norm.weight"])
    x = torch.cat([e, hn], -1)
    q, k, v = proj(x, "q_proj", heads), proj(x, "k_proj", kv), proj(x, "v_proj", kv)
    cos, sin = hf.model.rotary_emb(x, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, heads // kv), repeat_kv(v, heads // kv)
    scores = (q @ k.transpose(2, 3)) / d ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attn = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, n, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    r = (hn if norm_before_residual else feats) + attn
    m = rms(r, t["midlayer.post_attention_layernorm.weight"])
    out = r + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    reduced = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    full = torch.full((*reduced.shape[:-1], cfg.vocab_size), torch.finfo(torch.float32).min)
    full[..., torch.arange(reduced.shape[-1]) + t["d2t"]] = reduced
    return full, out


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_published_eagle3_layout_imports(target, tmp_path, norm_before_residual):
    """An EAGLE-3 checkpoint (fc 3H -> H, midlayer over [embedding; feature], its own norm and reduced LM head,
    d2t) computes what its layout defines; fc and the fused layers go to the target graph's feature pass."""
    from safetensors.torch import load_file

    from specc.heads.eagle3 import Eagle3Head

    path, hf = target
    vocab = [3, 5, 7] + list(range(40, 200))
    d = write_eagle3_checkpoint(path, tmp_path / "e3", layer_ids=[1, 1, 1], draft_vocab=vocab,
                                norm_before_residual=norm_before_residual)
    head, cfg = load_head(d, hf)
    assert isinstance(head, Eagle3Head) and cfg["kind"] == "eagle" and cfg["imported"] == "eagle3"
    assert head.feature_layers == (0, 0, 0) and cfg["feature_layers"] == [0, 0, 0]  # ids name the layer whose input is fused
    t = load_file(str(d / "model.safetensors"))
    assert torch.equal(head.fc.weight, t["fc.weight"])
    n = 5
    ids, feats = torch.randint(0, 256, (1, n)), torch.randn(1, n, hf.config.hidden_size)
    with torch.no_grad():
        logits, hidden, _, _ = head(ids, feats, torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                                    torch.arange(n)[None], head.empty_cache(1), head.empty_cache(1))
        want_logits, want_hidden = _eagle3_reference(t, hf, ids, feats, norm_before_residual)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_eagle3_checkpoints_with_problems_are_refused(target, tmp_path):
    path, hf = target
    cases = [
        (dict(layer_ids=[1, 1, 2]), "eagle_aux_hidden_state_layer_ids .* 1..1"),
        (dict(), "eagle_aux_hidden_state_layer_ids"),  # the default (2, L // 2, L - 3) does not fit 2 layers
    ]
    for i, (kwargs, message) in enumerate(cases):
        d = write_eagle3_checkpoint(path, tmp_path / f"c{i}", **kwargs)
        with pytest.raises(ModelError, match=message):
            load_head(d, hf)
    d = write_eagle3_checkpoint(path, tmp_path / "d2t", layer_ids=[1, 1, 1], draft_vocab=[3, 4, 5])
    t = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(d / "model.safetensors"))
    save_file({**t, "d2t": torch.tensor([0, 0, -1])}, str(d / "model.safetensors"))  # two draft ids on target id 4
    with pytest.raises(ModelError, match="d2t does not map"):
        load_head(d, hf)
    save_file({k: v for k, v in t.items() if k != "norm.weight"}, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match=r"missing \['norm.weight'\]"):
        load_head(d, hf)
    save_file({**t, "layers.1.mlp.up_proj.weight": torch.zeros(2)}, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match="unexpected"):
        load_head(d, hf)
    save_file(t, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    for bad, message in (({"num_hidden_layers": 2}, "one-layer EAGLE-3"),
                         ({"intermediate_size": 10 ** 12}, "intermediate_size is 1000000000000, its weights say"),
                         ({"num_attention_heads": "8"}, "num_attention_heads is '8'; expected a positive integer"),
                         ({"num_attention_heads": 2}, "head_dim 32"),
                         ({"rms_norm_eps": -1}, "rms_norm_eps"),
                         ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,1,1"}}, "eagle_aux_hidden_state_layer_ids")):
        (d / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ModelError, match=message):
            load_head(d, hf)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({**t, "d2t": t["d2t"].float()}, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match="d2t does not map"):
        load_head(d, hf)


def test_pickles_are_refused(target, tmp_path):
    path, hf = target
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    (d / "medusa_lm_head.pt").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelError, match="pickled weights .*does not unpickle"):
        load_head(d, hf)
    d3 = write_eagle3_checkpoint(path, tmp_path / "eagle3", layer_ids=[1, 1, 1])
    with pytest.raises(ModelError, match="hidden size 7"):
        (d3 / "config.json").write_text(json.dumps({"hidden_size": 7}))
        load_head(d3, hf)


def test_recipe_needs_a_head_for_head_methods():
    with pytest.raises(RecipeError, match="draft.head.*required"):
        parse_recipe({"target": {"model": "t"}, "draft": {"method": "eagle"}})
    with pytest.raises(RecipeError, match="draft.head.*only used with"):
        parse_recipe({"target": {"model": "t"}, "draft": {"method": "model", "model": "d", "head": "h"}})
    parse_recipe({"target": {"model": "t"}, "draft": {"method": "medusa", "head": "h"}, "speculation": {"mode": "tree"}})


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "-1"], ["--batch-seqs", "0"], ["--eval-every", "0"],
                                 ["--heads", "0"], ["--draft-vocab", "-5"], ["--new-tokens", "0"], ["--num-prompts", "0"],
                                 ["--unroll", "0"], ["--lr", "2"]])
def test_train_head_refuses_bad_settings_before_loading_the_target(tmp_path, monkeypatch, capsys, bad):
    import specc.models.load
    from specc.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the settings were checked")

    monkeypatch.setattr(specc.models.load, "load_model", no_load)
    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target:\n  model: smollm2-135m-instruct\ndraft:\n  method: prompt_lookup\n")
    assert main(["train-head", str(recipe), "--kind", "medusa", *bad, "-o", str(tmp_path / "head")]) == 2
    err = capsys.readouterr().err
    assert f"specc: error: {bad[0]} " in err and "allowed" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()


def _checkpoint(path, step="3", **meta) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({"head.fc.weight": torch.zeros(2, 2), "draft_vocab": torch.arange(64)}, str(path / "checkpoint.safetensors"),
              metadata={"step": step, **meta})


@pytest.mark.parametrize("case", ["a file", "other files", "another kind", "another kind, older checkpoint",
                                  "other heads", "other draft vocabulary", "unreadable checkpoint"])
def test_train_head_refuses_an_output_it_cannot_resume_before_loading_the_target(tmp_path, monkeypatch, capsys, case):
    """-o must be new, empty, or a head trained with these settings: anything else would overwrite files, or
    fail (or silently resume nothing) only after the data build."""
    import specc.models.load
    from specc.cli import main

    monkeypatch.setattr(specc.models.load, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe, out, kind = tmp_path / "r.yaml", tmp_path / "head", "medusa"
    recipe.write_text("target:\n  model: smollm2-135m-instruct\ndraft:\n  method: prompt_lookup\n")
    if case == "a file":
        out.write_text("notes")
    elif case == "other files":
        out.mkdir()
        (out / "config.json").write_text("{}")  # e.g. a published head
    elif case == "another kind":
        _checkpoint(out, kind="eagle")
    elif case == "another kind, older checkpoint":  # metadata of step only: the saved head's config says the kind
        _checkpoint(out)
        (out / "config.json").write_text(json.dumps({"format": "specc-head", "kind": "eagle", "eagle3": True}))
    elif case == "other heads":
        _checkpoint(out, kind="medusa", heads="2")
    elif case == "other draft vocabulary":
        _checkpoint(out, kind="eagle")
        kind = "eagle"
    else:
        out.mkdir()
        (out / "checkpoint.safetensors").write_bytes(b"not safetensors")
    args = ["train-head", str(recipe), "--kind", kind, "--steps", "5", "-o", str(out)]
    assert main(args + (["--draft-vocab", "32"] if case == "other draft vocabulary" else [])) == 2
    err = capsys.readouterr().err
    want = {"a file": "a file", "other files": "no train-head checkpoint", "another kind": "--kind eagle to resume",
            "another kind, older checkpoint": "--kind eagle3 to resume", "other heads": "--heads 2 to resume",
            "other draft vocabulary": "--draft-vocab 64 to resume", "unreadable checkpoint": "not a readable"}[case]
    assert want in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()


def test_resume_refuses_a_checkpoint_of_other_weights(target, tmp_path):
    """The backstop for checkpoints that say nothing of their settings: shapes are compared before loading."""
    from specc.errors import SpeccError
    from specc.heads.store import build_head
    from specc.training.checkpoints import resume, save_checkpoint

    _, hf = target
    medusa = build_head("medusa", hf, n_heads=2)
    save_checkpoint(tmp_path / "checkpoint.safetensors", medusa, torch.optim.AdamW(medusa.parameters()), 3, "medusa")
    eagle = build_head("eagle", hf)
    with pytest.raises(SpeccError, match="does not hold this head's weights"):
        resume(tmp_path / "checkpoint.safetensors", eagle, torch.optim.AdamW(eagle.parameters()))
    assert resume(tmp_path / "checkpoint.safetensors", medusa, torch.optim.AdamW(medusa.parameters())) == 3


@pytest.mark.parametrize("kind", ["medusa", "eagle"])  # eagle3: test_trained_eagle3_head_loads_compiles_and_stays_lossless
def test_train_head_trains_resumes_and_writes_a_card(target, tmp_path, monkeypatch, capsys, kind):
    from specc.cli import main
    from specc.training.heads import default_lr

    path, _ = target
    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {path}\ndraft:\n  method: prompt_lookup\n")
    args = ["train-head", str(recipe), "--kind", kind, "--num-prompts", "10", "--new-tokens", "12", "--eval-every", "2",
            "--draft-vocab", "64", "-o", str(tmp_path / "head")]
    assert main(args + ["--steps", "2", "--unroll", "0"]) == 2  # a clear error, before any data is built
    assert main(args + ["--steps", "2", "--lr", "-1"]) == 2
    assert main(args + ["--steps", "2"]) == 0
    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    ckpt = load_file(str(tmp_path / "head" / "checkpoint.safetensors"))
    heads_in_ckpt = {k.removeprefix("head."): v for k, v in ckpt.items() if k.startswith("head.")}
    assert heads_in_ckpt.keys() == saved.keys() - {"draft_vocab"}  # every weight the head owns, nothing of the target's
    assert all(torch.equal(v, saved[k]) for k, v in heads_in_ckpt.items())
    before = json.loads((tmp_path / "head" / "card.json").read_text())["held_out"]["greedy_acceptance_by_position"]
    assert main(args + ["--steps", "4"]) == 0  # resumes from the step-2 checkpoint
    assert main(args + ["--steps", "3"]) == 2  # fewer steps than the head has trained: refused, nothing rewritten
    assert main(args[:3] + ["eagle" if kind == "medusa" else "medusa"] + args[4:] + ["--steps", "6"]) == 2  # another kind
    card = json.loads((tmp_path / "head" / "card.json").read_text())
    assert card["resumed_from_step"] == 2 and card["steps"] == 4 and card["data"]["reused"]
    assert card["held_out"]["greedy_acceptance_by_position_before"] == before  # the step-2 head, restored
    assert len(card["held_out"]["greedy_acceptance_by_position"]) == 5 and card["draft_vocab_size"] == 64
    assert card["train"]["lr"] == 1e-3 and default_lr(1536) == 3e-4  # the default, by width (tiny here), recorded
    assert list((tmp_path / "cache" / "heads").glob("heads-data-*.safetensors"))
    assert not list((tmp_path / "cache" / "heads").glob("*.teacher-*"))  # its parts went with the whole
    assert torch.equal(ckpt["draft_vocab"], saved["draft_vocab"])

    # a second data set: only its prompts are answered, training resumes with the head's own draft vocabulary
    assert main(args + ["--num-prompts", "10", "--steps", "5", "--draft-vocab", "32"]) == 2  # not the head's vocabulary
    capsys.readouterr()
    assert main(args + ["--num-prompts", "10", "--steps", "5"]) == 0
    assert "set 2/2: target answers" in capsys.readouterr().err  # which set the progress bar is on
    card = json.loads((tmp_path / "head" / "card.json").read_text())
    first, second = card["data"]["sets"]
    assert first["reused"] and not second["reused"] and (second["code_from"], second["chat_from"]) == (5, 5)
    assert card["resumed_from_step"] == 4 and card["data"]["sequences"] == 20 and card["data"]["held_out_sequences"] == 2
    assert card["draft_vocab_from"].endswith("checkpoint.safetensors")
    assert card["held_out"]["rounds"] > 0 and len(card["held_out"]["round_acceptance_by_position_k3"]) == 3
    assert torch.equal(load_file(str(tmp_path / "head" / "model.safetensors"))["draft_vocab"], saved["draft_vocab"])


def test_init_target_starts_the_eagle_layer_as_the_targets_last(target, tmp_path, monkeypatch):
    """`--init target`: the layer's weights are the target's last layer's, fc passes the feature through
    (so the head's first layer input is the feature itself); refused for Medusa and Gemma-style norms."""
    from specc.cli import main
    from specc.errors import SpeccError
    from specc.heads.store import build_head
    from specc.testing import tiny_model
    from specc.training.head_init import start_from_target

    _, hf = target
    head = build_head("eagle", hf)
    start_from_target(head, hf)
    last = hf.model.layers[-1].state_dict()
    assert all(torch.equal(v, last[k]) for k, v in head.layers[0].state_dict().items())
    ids, feats = torch.tensor([[3, 5]]), torch.randn(1, 2, hf.config.hidden_size)
    assert torch.equal(head.fc(torch.cat([head.embed_tokens(ids), feats], -1)), feats)
    gemma = tiny_model("gemma")
    with pytest.raises(SpeccError, match="--init target: gemma"):
        start_from_target(build_head("eagle", gemma), gemma)

    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {target[0]}\ndraft:\n  method: prompt_lookup\n")
    args = ["train-head", str(recipe), "--num-prompts", "10", "--new-tokens", "8", "--steps", "2", "--init", "target"]
    assert main(args + ["--kind", "medusa", "-o", str(tmp_path / "m")]) == 2  # a clear error, before any data
    for kind in ("eagle", "eagle3"):
        assert main(args + ["--kind", kind, "-o", str(tmp_path / kind)]) == 0
        assert json.loads((tmp_path / kind / "card.json").read_text())["train"]["init"] == "target"


def test_init_target_starts_the_eagle3_midlayer_as_the_targets_last(target):
    """EAGLE-3's `--init target`: fed the input of the target's last layer, the head's midlayer computes
    that layer (its hidden state through the head's norm is the target's final hidden state); fc passes
    the highest fused layer through and the embedding's half of the attention input is unused at first."""
    from specc.heads.store import build_head
    from specc.training.head_init import start_from_target

    _, hf = target
    n_layers, hidden, n = hf.config.num_hidden_layers, hf.config.hidden_size, 6
    head = build_head("eagle3", hf, feature_layers=(n_layers - 1, 0))
    start_from_target(head, hf)
    a, b = torch.randn(2, 1, 3, hidden)
    assert torch.equal(head.fc(torch.cat([a, b], -1)), a)
    assert not head.midlayer.self_attn.q_proj.weight[:, :hidden].any()
    ids = torch.randint(0, 256, (1, n))
    with torch.no_grad():
        states = hf.model(ids, output_hidden_states=True).hidden_states
        _, out, _, _ = head(ids, states[n_layers - 1], torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                            torch.arange(n)[None], head.empty_cache(1), head.empty_cache(1))
    torch.testing.assert_close(head.norm(out), states[n_layers], rtol=1e-4, atol=1e-4)


def test_trained_eagle3_head_loads_compiles_and_stays_lossless(target, tmp_path, monkeypatch):
    """`train-head --kind eagle3`: a specc-layout EAGLE-3 head (fc over the default layers) that loads back
    as it was trained, compiles as draft.method eagle with the fusion in the target graph, and drafts
    without changing greedy output."""
    import specc
    from conftest import build_bundle
    from specc.cli import main
    from specc.heads.eagle3 import Eagle3Head
    from specc.heads.store import head_tensors

    path, hf = target
    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {path}\ndraft:\n  method: prompt_lookup\n")
    assert main(["train-head", str(recipe), "--kind", "eagle3", "--num-prompts", "8", "--new-tokens", "10", "--steps", "3",
                 "--draft-vocab", "0", "-o", str(tmp_path / "head")]) == 0
    head, cfg = load_head(tmp_path / "head", hf)
    assert isinstance(head, Eagle3Head) and cfg["kind"] == "eagle" and head.feature_layers == (0, 0, 0)
    saved = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "head" / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in head_tensors(head).items())
    bundle = build_bundle(tmp_path / "b", path, {"method": "eagle", "head": str(tmp_path / "head")}, backend="torch")
    model = specc.load(bundle)
    assert any("fused by the head's fc" in note for note in model.bundle.graph("target").passes)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    fast = model.generate(prompts, max_new_tokens=12)
    assert model.last_stats.to_dict()["rounds"] > 0
    slow = model.generate(prompts, max_new_tokens=12, speculative=False)
    assert [a.token_ids for a in fast] == [b.token_ids for b in slow]


def test_target_answers_resume_from_their_journal(target, tmp_path, monkeypatch):
    """An interrupted answers phase keeps its finished batches; the next run answers only the rest and gives
    what one uninterrupted run gives. A line cut short by the interruption is answered again."""
    from transformers import AutoTokenizer

    from specc.training.answers import generate

    path, model = target
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 4], [14, 15, 16]]
    whole, _ = generate(model, tok, prompts, 6, batch=2)
    journal, calls, real = tmp_path / "answers.jsonl", [], model.generate

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and interrupt:
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)

    interrupt = True
    monkeypatch.setattr(model, "generate", flaky)
    with pytest.raises(RuntimeError, match="interrupted"):
        generate(model, tok, prompts, 6, batch=2, journal=journal)
    assert len(journal.read_text().splitlines()) == 2  # the first batch
    journal.write_text(journal.read_text() + '{"ids": [1, 2')  # and half a line of the second
    calls.clear()
    interrupt = False
    assert generate(model, tok, prompts, 6, batch=2, journal=journal)[0] == whole
    assert len(calls) == 2 and len(journal.read_text().splitlines()) == 5  # batches 2 and 3 only
    other = [[7, 7]] + prompts[1:]  # batches of other prompts, or other batches, are answered again:
    calls.clear()  # by length, batches [0, 1], [3, 4], [2] where the journal holds [1, 3], [0, 4], [2]
    generate(model, tok, other, 6, batch=2, journal=journal)
    assert len(calls) == 2


@pytest.mark.parametrize("layers", [None, [0, 0, 0]])
def test_answers_record_what_the_teacher_pass_computes(target, tmp_path, monkeypatch, layers):
    """The passes that answer record every position's feature and top-K (left-padded batches, the prompt's
    positions through the LM head again): what the teacher pass computes over the same tokens, up to float
    rounding. An answer cut by the token limit loses its last token (its pass never ran). A later call
    reads the records beside the journal; build_data sends only a batch without one to the teacher pass."""
    from transformers import AutoTokenizer

    import specc.training.head_data as hd
    from specc.training.answers import Recorder
    from specc.training.prompt_corpora import encode

    path, model = target
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["def f(", "x", "import os\nclass A:", "y =", "for i in"]  # padded in batches of 3
    monkeypatch.setattr(hd, "training_prompts", lambda cfg: [(t, False) for t in texts])
    monkeypatch.setattr(Recorder, "LOGIT_ROWS", 4)  # the prompt positions' extra LM-head pass in several pieces
    cfg = hd.DataConfig(n_code=5, n_chat=0, new_tokens=6, top_k=4, batch=3)
    prompts = [encode(tok, t, False, cfg.max_prompt_tokens) for t in texts]
    key = cfg.key("t") + ("-l" + "-".join(map(str, layers)) if layers else "")  # build_data's cache name
    data_file = tmp_path / f"heads-data-{key}.safetensors"
    journal = data_file.with_suffix(".answers.jsonl")
    seqs, recorded = hd.generate(model, tok, prompts, 6, batch=3, journal=journal, top_k=4, feature_layers=layers)
    assert sorted(recorded) == list(range(5)) and len({len(p) for p in prompts}) == 5
    for i, (ids, n_prompt) in enumerate(seqs):
        n = recorded[i]["length"]
        assert n == n_prompt + min(len(ids) - n_prompt, 5)
        taught = hd.teacher_pass(model, [(ids[:n], n_prompt)], 4, layers)
        torch.testing.assert_close(recorded[i]["features"].float(), taught["features"][0].float(), atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(recorded[i]["top_val"].float(), taught["top_val"][0].float(), atol=2e-3, rtol=1e-2)
        assert torch.equal(recorded[i]["top_idx"], taught["top_idx"][0])
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("answered again"))
    again_seqs, again = hd.generate(model, tok, prompts, 6, batch=3, journal=journal, top_k=4, feature_layers=layers)
    assert again_seqs == seqs and all(torch.equal(again[i][k], recorded[i][k]) for i in recorded
                                      for k in ("features", "top_val", "top_idx"))
    records = sorted(tmp_path.glob("*.answers.batch-*.safetensors"))
    assert len(records) == 2
    records[1].unlink()  # the longer prompts' batch, as if journaled before answers recorded their data
    data, _ = hd.build_data(model, tok, "t", cfg, tmp_path, layers)
    assert data["features"].shape[-1] == model.config.hidden_size * (3 if layers else 1)
    lengths = data["valid"].sum(1).tolist()
    by_teacher = [i for i in range(5) if lengths[i] == len(seqs[i][0]) != recorded[i]["length"]]
    assert by_teacher and all(lengths[i] in (recorded[i]["length"], len(seqs[i][0])) for i in range(5))
    for i in range(5):
        assert data["tokens"][i, :lengths[i]].tolist() == seqs[i][0][:lengths[i]]
        assert int(data["answer"][i].sum()) == lengths[i] - seqs[i][1]
        if i not in by_teacher:
            assert torch.equal(data["features"][i, :lengths[i]], recorded[i]["features"])
    assert [p.name for p in tmp_path.iterdir()] == [data_file.name]


def test_eagle_training_unroll_drafts_as_the_runtime_does(target):
    """Training-time test: step s of the unrolled loss, at every round o at once, equals drafting
    step by step with the head's own cache (true entries 0..o, then the round's draft entries)."""
    from specc.heads.store import build_head
    from specc.training.losses import eagle_unroll

    _, hf = target
    torch.manual_seed(0)
    head = build_head("eagle", hf).eval()
    with torch.no_grad():
        for p in head.trainable():
            p.normal_(0.0, 0.3 / p.shape[-1] ** 0.5)
    b, t, steps = 2, 9, 3
    tokens = torch.randint(0, hf.config.vocab_size, (b, t))
    feats = torch.randn(b, t, hf.config.hidden_size)
    with torch.no_grad():
        unrolled = eagle_unroll(head, tokens, feats, steps)
        assert [u.shape[1] for u in unrolled] == [t - 1, t - 2, t - 3]
        for o in (0, 3, t - 1 - steps):
            h, k, v = head.run(tokens[:, 1:o + 2], feats[:, :o + 1], torch.arange(o + 1)[None].expand(b, -1),
                               torch.zeros(b, dtype=torch.long), head.empty_cache(b), head.empty_cache(b))
            last = h[:, -1:]
            torch.testing.assert_close(unrolled[0][:, o], last[:, 0], rtol=1e-5, atol=1e-5)
            for s in range(1, steps):
                pos = torch.full((b, 1), o + s)
                last, nk, nv = head.run(tokens[:, o + 1 + s:o + 2 + s], last, pos, torch.full((b,), k.shape[3]), k, v)
                k, v = torch.cat([k, nk], 3), torch.cat([v, nv], 3)
                torch.testing.assert_close(unrolled[s][:, o], last[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_held_out_chains_from_one_pass_equal_chains_from_each_prefix(target, kind):
    """The held-out estimate enters a row's true entries once and starts every round from a slice of that
    cache: the drafts equal those of a round that enters its own prefix (as the runtime's rounds do)."""
    from specc.heads.store import build_head
    from specc.training.held_out import _eagle_chain, _eagle_enter

    _, hf = target
    torch.manual_seed(0)
    head = build_head(kind, hf).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    width = hf.config.hidden_size * (3 if kind == "eagle3" else 1)
    n, depth = 12, 4
    data = {"tokens": torch.randint(0, 256, (1, n + 1)), "features": torch.randn(1, n, width)}
    with torch.no_grad():
        entered = _eagle_enter(head, data, 0, n)
        for o in (0, 5, n - 1):
            feats = data["features"][:, :o + 1]
            feats = head.fc(feats) if kind == "eagle3" else feats
            logits, h, k, v = head(data["tokens"][:, 1:o + 2], feats, torch.arange(o + 1)[None], torch.zeros(1, dtype=torch.long),
                                   torch.tensor([[o]]), head.empty_cache(1), head.empty_cache(1))
            want = []
            for i in range(depth):
                want.append(logits[:, 0].argmax(-1))
                logits, h, nk, nv = head(want[-1][:, None], h[:, -1:], torch.tensor([[o + 1 + i]]), torch.tensor([k.shape[3]]),
                                         torch.zeros(1, 1, dtype=torch.long), k, v)
                k, v = torch.cat([k, nk], 3), torch.cat([v, nv], 3)
            assert torch.equal(_eagle_chain(head, entered, o, depth), torch.cat(want))


def test_training_prompts_leave_out_the_benchmark_and_vary():
    """Training code comes from many standard-library modules, never the benchmark's; no chat prompt is
    a benchmark prompt; the grid gives far more distinct chat prompts than one run asks for."""
    from specc.prompts import CHAT, build
    from specc.training.data_config import DataConfig
    from specc.training.prompt_corpora import training_prompts
    from specc.training.stdlib_sources import stdlib_sources

    sources = stdlib_sources()
    names = {p.stem for p in sources}
    assert len(sources) > 200 and not {"heapq", "textwrap", "fractions", "statistics"} & names
    prompts = training_prompts(DataConfig(n_code=400, n_chat=400))
    code, chat = [p for p, c in prompts if not c], [p for p, c in prompts if c]
    assert len(code) == len(chat) == 400 and len(set(chat)) == 400
    bench = {it["prompt"] for it in build(16, len(CHAT))}
    assert not bench & set(code) and not set(CHAT) & set(chat)


def test_round_acceptance_counts_rounds_as_a_greedy_run_does(monkeypatch):
    """The card's greedy-run estimate: rounds start where the answer does and each next one after the
    accepted drafts and the target's token, so a head that is always right takes k + 1 positions a
    round, one that is always wrong 1, one right only first 2."""
    from specc.training import held_out

    n, p, k = 20, 5, 3
    argmax = torch.arange(100, 100 + n)
    data = {"valid": torch.ones(1, n + 4, dtype=torch.bool), "answer": torch.zeros(1, n + 4, dtype=torch.bool),
            "top_idx": torch.zeros(1, n + 4, 2, dtype=torch.long)}
    data["valid"][0, n:] = False
    data["answer"][0, p:n] = True
    data["top_idx"][0, :n, 0] = argmax
    cases = {"right": (lambda o, k: argmax[o + 1:o + 1 + k], [1.0, 1.0, 1.0], 4),  # o = 4, 8, 12, 16
             "wrong": (lambda o, k: argmax[o + 1:o + 1 + k] + 1, [0.0, 0.0, 0.0], 13),  # o = 4 .. 16
             "first": (lambda o, k: torch.cat([argmax[o + 1:o + 2], argmax[o + 2:o + 1 + k] + 1]), [1.0, 0.0, 0.0], 7)}
    for draft, by_position, rounds in cases.values():
        monkeypatch.setattr(held_out, "_drafter", lambda *a, draft=draft: draft)
        assert held_out.round_acceptance(None, data, torch.tensor([0]), k) == (by_position, rounds)


def test_consecutive_data_sets_take_prompts_after_the_earlier_sets():
    """`--num-prompts 5 --num-prompts 5 --num-prompts 5`: three sets whose prompts are disjoint and together are the
    prompts of one set as large (odd counts too); the first set's cache key is the one-set key."""
    from specc.training.data_config import DataConfig
    from specc.training.prompt_corpora import training_prompts
    from specc.training.stdlib_sources import text_windows
    from specc.training.heads import consecutive_sets

    sets = consecutive_sets([5, 5, 5], new_tokens=8)
    assert [(d.code_from, d.n_code, d.chat_from, d.n_chat) for d in sets] == [(0, 2, 0, 3), (2, 2, 3, 3), (4, 2, 6, 3)]
    assert sets[0].key("m") == DataConfig(n_code=2, n_chat=3, new_tokens=8).key("m") != sets[1].key("m")
    parts = [training_prompts(d) for d in sets]
    whole = training_prompts(DataConfig(n_code=6, n_chat=9))
    assert sorted(p for part in parts for p in part) == sorted(whole) and len(set(whole)) == 15

    class Chars:  # one token per character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    windows = text_windows(Chars(), 6, 16)
    assert text_windows(Chars(), 2, 16, first=4) == windows[4:6] and len(set(map(tuple, windows))) == 6


def test_training_text_leaves_out_the_benchmark_modules():
    """`--source text` windows come from modules no benchmark prompt is taken from."""
    from specc.prompts import STDLIB_MODULES
    from specc.training.stdlib_sources import TRAIN_MODULES

    assert not set(TRAIN_MODULES) & set(STDLIB_MODULES)
    assert not any(m.startswith(b + ".") or b.startswith(m + ".") for m in TRAIN_MODULES for b in STDLIB_MODULES)


def test_teacher_pass_resumes_from_its_saved_parts(target, tmp_path):
    """An interrupted teacher pass keeps its finished parts; the next run computes only the rest and gives
    what one uninterrupted run gives. A part cut short, or one over other sequences, is computed again."""
    from specc.training.teacher_pass import teacher_pass

    _, model = target
    seqs = [([5, 6, 7, 8], 1), ([8, 9], 1), ([10, 11, 12, 13, 14], 2), ([3, 4, 5], 0), ([14, 15, 16], 2)]
    whole = teacher_pass(model, seqs, 4)
    parts, calls, real = tmp_path / "data.safetensors", [], model.model

    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()

        def forward(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3 and interrupt:
                raise RuntimeError("interrupted")
            return real(*args, **kwargs)

    interrupt = True
    model.model = Flaky()  # not monkeypatch: its undo deletes the submodule (it reads no old value)
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            teacher_pass(model, seqs, 4, parts=parts, chunk=2)
        assert [p.name for p in tmp_path.iterdir()] == ["data.teacher-00000.safetensors"]  # the first part
        interrupt = False
        calls.clear()
        again = teacher_pass(model, seqs, 4, parts=parts, chunk=2)
        assert len(calls) == 3 and set(again) == set(whole)
        assert all(torch.equal(again[k], whole[k]) for k in whole)
        (tmp_path / "data.teacher-00002.safetensors").write_bytes(b"cut short")
        other = [([7, 7, 7], 1)] + seqs[1:]  # the first part was over other sequences
        calls.clear()
        teacher_pass(model, other, 4, parts=parts, chunk=2)
        assert len(calls) == 4
    finally:
        model.model = real  # the module-scoped target is shared


def test_train_head_in_bfloat16_keeps_its_own_data_and_float32_weights(target, tmp_path, monkeypatch, capsys):
    """--dtype bfloat16: the target's passes and the losses run in bfloat16, the data set is cached apart from
    the float32 one, and the head's weights (what compile reads) stay float32. On a CPU without native
    bfloat16 the run goes on with a warning that it is emulated there."""
    from safetensors.torch import load_file

    import specc.hardware
    from specc.cli import main

    monkeypatch.setattr(specc.hardware, "cpu", lambda: {"native_bfloat16": False})

    path, _ = target
    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {path}\ndraft:\n  method: prompt_lookup\n")
    args = ["train-head", str(recipe), "--kind", "eagle", "--num-prompts", "10", "--new-tokens", "8", "--steps", "2",
            "--draft-vocab", "64"]
    assert main(args + ["--dtype", "bfloat16", "-o", str(tmp_path / "bf16")]) == 0
    assert "--dtype bfloat16 is emulated here" in capsys.readouterr().err
    card = json.loads((tmp_path / "bf16" / "card.json").read_text())
    assert card["train"]["dtype"] == card["data"]["dtype"] == "bfloat16" and not card["data"]["reused"]
    weights = load_file(str(tmp_path / "bf16" / "model.safetensors")).values()
    assert {t.dtype for t in weights if t.is_floating_point()} == {torch.float32}
    assert main(args + ["-o", str(tmp_path / "fp32")]) == 0
    assert "emulated" not in capsys.readouterr().err
    assert not json.loads((tmp_path / "fp32" / "card.json").read_text())["data"]["reused"]
    assert len(list((tmp_path / "cache" / "heads").glob("heads-data-*.safetensors"))) == 2


def test_self_written_chat_prompts_are_sampled_once_and_kept(target, tmp_path, monkeypatch):
    """chat="self": the target writes the set's user messages (one per seed of kind x topic), kept in a
    file that a rerun reads instead of sampling again; grid sets keep the cache keys they always had."""
    from transformers import AutoTokenizer

    from specc.training.data_config import DataConfig
    from specc.training.self_questions import _clean_question, question_seeds, written_questions

    path, model = target
    tok = AutoTokenizer.from_pretrained(path)
    cfg = DataConfig(n_code=2, n_chat=5, new_tokens=4, batch=3, chat="self")
    questions = written_questions(model, tok, cfg, tmp_path / "q.json")
    assert len(questions) == 5 and all(isinstance(q, str) and 8 <= len(q) <= 400 for q in questions)
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("sampled again"))
    assert written_questions(model, tok, cfg, tmp_path / "q.json") == questions
    later = question_seeds(DataConfig(n_chat=5, chat_from=5, chat="self"))
    assert len({s for s, _ in question_seeds(cfg) + later}) == 10  # the next set's seeds are others
    assert _clean_question('\n  Question: "How do tides work?"\nMore text') == "How do tides work?"
    assert _clean_question("**Write a poem about rain.**") == "Write a poem about rain."
    assert _clean_question("Dear AI,\nCould you list three rivers?") == "Could you list three rivers?"
    assert _clean_question("Sure, here is an example request:\n\nQ: What is DNA?") == "What is DNA?"
    assert _clean_question('Sure! "Hey AI, how does Git work?') == "Hey AI, how does Git work?"
    assert _clean_question("Subject: Help\n") == ""
    for reply in ("Sure, please provide the sentence you would like me to rewrite.", "I'm sorry, but I can't assist.",
                  "Could you please provide the sentence?", "Certainly! What would you like to know about tides?",
                  "As an AI, I don't have feelings."):  # the target answering as the assistant
        assert _clean_question(reply) == "", reply
    assert _clean_question("Could you tell me about the tides near the beach?") == "Could you tell me about the tides near the beach?"
    assert cfg.key("m") != DataConfig(n_code=2, n_chat=5, new_tokens=4, batch=3).key("m")
    grid = DataConfig(n_code=192, n_chat=192, new_tokens=64, code_from=224, chat_from=224)
    assert grid.key("qwen2.5-coder-1.5b-instruct") == "bfab04c63af643f0"  # a set cached by earlier versions


def test_unusable_written_messages_are_sampled_again_then_templated(target, tmp_path, monkeypatch):
    """A reply that is no user message is sampled again (RESAMPLES times, only those rows), then falls back."""
    from transformers import AutoTokenizer

    from specc.training import self_questions
    from specc.training.data_config import DataConfig
    from specc.training.self_questions import question_seeds, written_questions

    path, model = target
    tok = AutoTokenizer.from_pretrained(path)
    cfg = DataConfig(n_chat=3, batch=4, chat="self")
    replies = iter([["Why do tides rise?", "Sure, please provide the sentence.", "I'm sorry, but I can't."],
                    ["How do magnets work?", "As an AI, I can't."], ["Certainly! What would you like?"]])
    calls = []

    def generate(input_ids, **kwargs):
        texts = next(replies)
        calls.append(len(input_ids))
        assert len(texts) == len(input_ids)
        new = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, new))
        return torch.cat([input_ids, torch.tensor([n + [tok.eos_token_id] * (width - len(n)) for n in new])], 1)

    monkeypatch.setattr(model, "generate", generate)
    questions = written_questions(model, tok, cfg, tmp_path / "q.json")
    topic = question_seeds(cfg)[2][1]
    assert questions == ["Why do tides rise?", "How do magnets work?", f"Tell me about {topic}."]
    assert calls == [3, 2, 1] and self_questions.RESAMPLES == 2


def test_train_head_with_self_written_chat(target, tmp_path, monkeypatch, capsys):
    from specc.cli import main

    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  model: {target[0]}\ndraft:\n  method: prompt_lookup\n")
    args = ["train-head", str(recipe), "--kind", "eagle", "--new-tokens", "6", "--steps", "2", "-o", str(tmp_path / "h")]
    assert main(args + ["--num-prompts", "8:nonsense"]) == 2 and "N:self" in capsys.readouterr().err
    assert main(args + ["--num-prompts", "8:self", "--source", "text"]) == 2
    assert not (tmp_path / "cache").exists()  # both refused before anything was built
    assert main(args + ["--num-prompts", "8", "--num-prompts", "8:self"]) == 0
    first, second = json.loads((tmp_path / "h" / "card.json").read_text())["data"]["sets"]
    assert (first["chat"], second["chat"], second["sequences"]) == ("grid", "self", 8)
    assert len(json.loads(next((tmp_path / "cache" / "heads").glob("*.questions.json")).read_text())) == 4


def test_another_kinds_features_reuse_the_cached_answers(target, tmp_path, monkeypatch):
    """A set cached with last-layer features (eagle) gives its answers to the same set with EAGLE-3's
    layers: only the teacher pass runs, over exactly the cached tokens, and its features are the layers'."""
    from transformers import AutoTokenizer

    import specc.training.head_data as hd

    path, model = target
    tok = AutoTokenizer.from_pretrained(path)
    monkeypatch.setattr(hd, "training_prompts", lambda cfg: [(t, False) for t in ["def f(", "x", "import os\nclass A:"]])
    cfg = hd.DataConfig(n_code=3, n_chat=0, new_tokens=6, top_k=4, batch=2)
    first, info = hd.build_data(model, tok, "t", cfg, tmp_path)
    assert "answers_from" not in info
    monkeypatch.setattr(hd, "generate", lambda *a, **k: pytest.fail("answered again"))
    part = hd.teacher_pass(model, [(first["tokens"][0, :3].tolist(), 1)], 4, [0, 1, 0])  # an interrupted run's part:
    save_file(part, str(tmp_path / f"heads-data-{cfg.key('t')}-l0-1-0.teacher-00000.safetensors"))  # not a sibling
    other = dataclasses.replace(cfg, new_tokens=7)  # other settings: not a sibling (generate fails the test)
    with pytest.raises(pytest.fail.Exception):
        hd.build_data(model, tok, "t", other, tmp_path, [0, 1, 0])
    data, info = hd.build_data(model, tok, "t", cfg, tmp_path, [0, 1, 0])
    assert info["answers_from"] == info["cache"].replace("-l0-1-0", "") and not info["reused"]
    for k in ("tokens", "valid", "answer"):
        assert torch.equal(data[k], first[k]), k
    assert torch.equal(data["top_idx"][data["valid"]], first["top_idx"][first["valid"]])
    n = int(data["valid"][0].sum())
    want = hd.teacher_pass(model, [(data["tokens"][0, :n].tolist(), 0)], 4, [0, 1, 0])["features"][0]
    assert data["features"].shape[-1] == 3 * model.config.hidden_size and torch.equal(data["features"][0, :n], want)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(info["cache"]).name, Path(info["answers_from"]).name])
