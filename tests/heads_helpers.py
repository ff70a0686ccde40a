"""Untrained Medusa / EAGLE heads with random weights for tiny targets: partly right by chance,
which is what the lossless checks need (drafts both accepted and rejected)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specc.heads.store import build_head, save_head


def make_random_head(kind: str, target: Path, path: Path, seed: int = 0, scale: float = 0.3, **kwargs) -> Path:
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    torch.manual_seed(seed)
    head = build_head(kind, hf, **kwargs)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0.0, scale / p.shape[1] ** 0.5)
    return save_head(path, head, hf, card={"kind": kind, "random": True})


def write_eagle3_checkpoint(target: Path, path: Path, seed: int = 0, scale: float = 1.0, layer_ids: list[int] | None = None,
                            draft_vocab: list[int] | None = None, norm_before_residual: bool = False) -> Path:
    """A random EAGLE-3 head in the published layout (config.json + model.safetensors with fc, midlayer.*,
    norm, lm_head and d2t) for a tiny target, as SafeAILab/EAGLE and SpecForge write them."""
    import json

    from safetensors.torch import save_file

    cfg = AutoModelForCausalLM.from_pretrained(target).config
    h, heads, kv, inter = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    d = h // heads
    rows = len(draft_vocab) if draft_vocab is not None else cfg.vocab_size
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * d), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (rows, h)}
    torch.manual_seed(seed)
    tensors = {k: torch.randn(s) * scale / s[1] ** 0.5 for k, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h)
    ids = torch.tensor(draft_vocab if draft_vocab is not None else range(cfg.vocab_size))
    tensors["d2t"] = ids - torch.arange(rows)
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, True)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": cfg.vocab_size, "draft_vocab_size": rows,
              "norm_before_residual": norm_before_residual}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(config))
    return path
