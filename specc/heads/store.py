"""Heads on disk: specc's own layout, and the published Medusa and EAGLE layouts (read only).

specc layout (what `specc train-head` writes), a directory:
  config.json        {"format": "specc-head", "kind": "medusa"|"eagle", ...}
  model.safetensors  the trained weights (+ `draft_vocab` when the head has a reduced vocabulary)
  card.json          data, steps, time, held-out agreement and acceptance by position

Published layouts (a directory with config.json + safetensors):
  Medusa (FasterDecoding/Medusa): config.json with medusa_num_heads / medusa_num_layers;
    medusa_lm_head.safetensors with `{i}.{j}.linear.weight|bias` (residual blocks) and
    `{i}.{medusa_num_layers}.weight` (each head's own LM head).
  EAGLE-1/2 (SafeAILab/EAGLE): a Llama-style config.json; model.safetensors with `fc.weight|bias`
    and `layers.0.*` (one decoder layer without input_layernorm); `embed_tokens` is the target's.
  EAGLE-3 (SafeAILab/EAGLE, SpecForge, as vLLM and SGLang load them): a Llama-style config.json
    (`draft_vocab_size`, optional `eagle_config.eagle_aux_hidden_state_layer_ids`, default
    (2, L // 2, L - 3): the layers whose input is fused, `norm_before_residual`); safetensors with
    `fc.weight` [H, 3H], `midlayer.*`, `norm.weight`, `lm_head.weight` [V', H] and `d2t` (draft id i
    is target id i + d2t[i]); `t2d` and `embed_tokens` are not needed (the target's embedding).
Pickled weights (.bin, .pt, .pth) are refused: loading them runs arbitrary code.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ModelError
from .eagle import EagleHead
from .eagle3 import Eagle3Head, default_feature_layers, fresh_eagle3
from .medusa import MedusaHeads

KINDS = ("medusa", "eagle", "eagle3")
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _target_facts(target) -> dict:
    cfg = target.config
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_hidden_layers}


def head_config(head: torch.nn.Module, target) -> dict:
    """The config.json of a specc head."""
    cfg = {"format": "specc-head", "target": _target_facts(target)}
    vocab = head.vocab.draft_vocab
    cfg["draft_vocab_size"] = None if vocab is None else int(vocab.numel())
    if isinstance(head, MedusaHeads):
        cfg.update(kind="medusa", medusa_num_heads=head.n_heads, medusa_num_layers=len(head.heads[0]),
                   shared_lm_head=head.lm_heads is None)
    elif isinstance(head, Eagle3Head):  # runs as draft.method eagle
        cfg.update(kind="eagle", eagle3=True, feature_layers=list(head.feature_layers))
    else:
        cfg.update(kind="eagle", fc_bias=head.fc.bias is not None)
    return cfg


def head_tensors(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a head owns (not the target's embedding, rotary tables or shared LM head rows)."""
    skip = ("embed_tokens.", "rotary_emb.", "vocab.draft_vocab")
    out = {k: v for k, v in head.state_dict().items() if not k.startswith(skip) and k not in ("lm_head", "shared")}
    if head.vocab.draft_vocab is not None:
        out["draft_vocab"] = head.vocab.draft_vocab
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_head(path: str | Path, head: torch.nn.Module, target, card: dict | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(head), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head_config(head, target), indent=2))
    if card is not None:
        (path / "card.json").write_text(json.dumps(card, indent=2))
    return path


def build_head(kind: str, target, *, n_heads: int = 4, n_layers: int = 1, shared_lm_head: bool = True,
               draft_vocab: torch.Tensor | None = None, fc_bias: bool = True,
               feature_layers: tuple[int, ...] | None = None) -> torch.nn.Module:
    """A fresh (untrained) head of this kind for this target (eagle3: fusing `feature_layers`, by default
    EAGLE-3's)."""
    if kind == "medusa":
        cfg = target.config
        return MedusaHeads(cfg.hidden_size, n_heads, n_layers, target.lm_head.weight, cfg.vocab_size, draft_vocab,
                           shared_lm_head)
    if kind == "eagle":
        return EagleHead(target, draft_vocab, fc_bias)
    if kind == "eagle3":
        return fresh_eagle3(target, draft_vocab, feature_layers or default_feature_layers(target.config.num_hidden_layers))
    raise ModelError(f"head kind {kind!r} is not known; allowed: {', '.join(KINDS)}")


def _refuse_pickles(path: Path) -> None:
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLES)
    if pickles and not any(p.suffix == ".safetensors" for p in path.iterdir()):
        raise ModelError(f"head {path} holds only pickled weights ({', '.join(pickles)}); specc does not unpickle "
                         "(it can run arbitrary code). Convert them to safetensors first, e.g. "
                         "safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')")


def _read_tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    for name in names:
        if (path / name).is_file():
            try:
                return load_file(str(path / name))
            except Exception as exc:  # safetensors raises several types for unreadable files
                raise ModelError(f"{path / name} is not a readable safetensors file: {exc}") from None
    raise ModelError(f"head {path} has no weights file; expected one of: {', '.join(names)}")


def _check_target(path: Path, cfg: dict, target) -> None:
    hidden = cfg.get("hidden_size") or cfg.get("target", {}).get("hidden_size")
    if hidden is not None and hidden != target.config.hidden_size:
        raise ModelError(f"head {path} was made for hidden size {hidden}, the target has {target.config.hidden_size}")


def load_head(path: str | Path, target) -> tuple[torch.nn.Module, dict]:
    """A head from a specc, Medusa, EAGLE-1/2 or EAGLE-3 directory, bound to the target; returns (module, config)."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelError(f"head {path} is not a directory with a config.json (a `specc train-head` output, or a "
                         "published Medusa or EAGLE head)")
    _refuse_pickles(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    _check_target(path, cfg, target)
    if cfg.get("format") == "specc-head":
        tensors = _read_tensors(path, ("model.safetensors",))
        draft_vocab = tensors.pop("draft_vocab", None)
        if cfg["kind"] == "medusa":
            head = build_head("medusa", target, n_heads=cfg["medusa_num_heads"], n_layers=cfg["medusa_num_layers"],
                              shared_lm_head=cfg["shared_lm_head"], draft_vocab=draft_vocab)
        elif cfg.get("eagle3"):
            layers, n = cfg.get("feature_layers"), target.config.num_hidden_layers
            if not (isinstance(layers, list) and len(layers) == 3 and all(isinstance(i, int) and 0 <= i < n for i in layers)):
                raise ModelError(f"head {path}: feature_layers {layers!r} must be 3 layer indices in 0..{n - 1} of this target")
            head = build_head("eagle3", target, draft_vocab=draft_vocab, feature_layers=tuple(layers))
        else:
            head = build_head("eagle", target, draft_vocab=draft_vocab, fc_bias=cfg.get("fc_bias", True))
        _load_owned(head, tensors, path)
        return head.eval(), cfg
    if "medusa_num_heads" in cfg:
        return _import_medusa(path, cfg, target), {**cfg, "kind": "medusa", "imported": "medusa"}
    tensors = _read_tensors(path, ("model.safetensors", "pytorch_model.safetensors"))
    if any(k.removeprefix("model.").startswith("midlayer.") for k in tensors):
        head = _import_eagle3(path, cfg, tensors, target)
        return head, {**cfg, "kind": "eagle", "imported": "eagle3", "feature_layers": list(head.feature_layers)}
    if "fc.weight" in tensors:
        return _import_eagle(path, tensors, target), {**cfg, "kind": "eagle", "imported": "eagle"}
    raise ModelError(f"head {path}: config.json is neither a specc head, a Medusa head (medusa_num_heads) nor an "
                     "EAGLE head (weights with fc.weight and layers.0.*, or EAGLE-3's midlayer.*)")


def _load_owned(head: torch.nn.Module, tensors: dict, path: Path) -> None:
    own = set(head_tensors(head)) - {"draft_vocab"}
    missing, extra = sorted(own - set(tensors)), sorted(set(tensors) - own)
    if missing or extra:
        raise ModelError(f"head {path}: weights do not match its config (missing {missing[:4]}, unexpected {extra[:4]})")
    head.load_state_dict(tensors, strict=False)


def _import_medusa(path: Path, cfg: dict, target) -> torch.nn.Module:
    n_heads, n_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    tensors = _read_tensors(path, ("medusa_lm_head.safetensors", "model.safetensors"))
    head = build_head("medusa", target, n_heads=n_heads, n_layers=n_layers, shared_lm_head=False)
    mapped = {}
    for key, value in tensors.items():
        parts = key.removeprefix("medusa_head.").split(".")
        i, j = int(parts[0]), int(parts[1])
        if j == n_layers:
            mapped[f"lm_heads.{i}.weight"] = value
        else:
            mapped[f"heads.{i}.{j}.{'.'.join(parts[2:])}"] = value
    _load_owned(head, {k: v.float() for k, v in mapped.items()}, path)
    return head.eval()


def _import_eagle(path: Path, tensors: dict, target) -> torch.nn.Module:
    tensors = {k.removeprefix("model."): v.float() for k, v in tensors.items()
               if not k.removeprefix("model.").startswith("embed_tokens.")}
    head = build_head("eagle", target, fc_bias="fc.bias" in tensors)
    _load_owned(head, tensors, path)
    return head.eval()


def _eagle3_layers(path: Path, cfg: dict, n_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs EAGLE-3's fc fuses: its aux ids name the layer whose *input* is taken."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n_layers // 2, n_layers - 3]
    if (not isinstance(ids, list) or len(ids) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i < n_layers for i in ids)):
        raise ModelError(f"head {path}: eagle_aux_hidden_state_layer_ids {ids!r} must be 3 layer indices in 1..{n_layers - 1} "
                         f"for this {n_layers}-layer target")
    return tuple(i - 1 for i in ids)


def _config_int(path: Path, cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelError(f"head {path}: config.json {key} is {value!r}; expected a positive integer")
    return value


def _import_eagle3(path: Path, cfg: dict, tensors: dict, target) -> torch.nn.Module:
    """An EAGLE-3 head whose layer sizes come from its tensors (the config must agree with them: a config
    alone never decides what is allocated)."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    hidden, vocab_size = target.config.hidden_size, target.config.vocab_size
    if cfg.get("target_hidden_size", hidden) != hidden:
        raise ModelError(f"head {path} was made for a target of hidden size {cfg['target_hidden_size']}, this one has {hidden}")
    if _config_int(path, cfg, "num_hidden_layers", 1) != 1:
        raise ModelError(f"head {path} has {cfg['num_hidden_layers']} draft layers; specc runs one-layer EAGLE-3 heads")
    needed = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
              "midlayer.mlp.gate_proj.weight", "lm_head.weight")
    missing = [k for k in needed if k not in tensors or tensors[k].dim() != 2]
    if missing:
        raise ModelError(f"head {path}: EAGLE-3 weights lack {missing[:4]} (2-D tensors)")
    n_heads = _config_int(path, cfg, "num_attention_heads", target.config.num_attention_heads)
    head_dim = _config_int(path, cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // n_heads
    target_dim = getattr(target.config, "head_dim", None) or hidden // target.config.num_attention_heads
    if head_dim != target_dim:
        raise ModelError(f"head {path} has head_dim {head_dim}; specc runs EAGLE-3 heads with the target's rotary tables, "
                         f"which need the target's head_dim {target_dim}")
    q, k = tensors["midlayer.self_attn.q_proj.weight"].shape, tensors["midlayer.self_attn.k_proj.weight"].shape
    if q != (n_heads * head_dim, 2 * hidden) or k[1] != 2 * hidden or k[0] % head_dim:
        raise ModelError(f"head {path}: attention weights q {tuple(q)}, k {tuple(k)} do not fit {n_heads} heads of "
                         f"{head_dim} over [embedding; feature] ({2 * hidden} wide)")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ModelError(f"head {path}: config.json rms_norm_eps is {eps!r}; expected a number in (0, 1)")
    sizes = {"num_attention_heads": n_heads, "num_key_value_heads": k[0] // head_dim, "head_dim": head_dim,
             "intermediate_size": tensors["midlayer.mlp.gate_proj.weight"].shape[0], "rms_norm_eps": float(eps),
             "attention_bias": "midlayer.self_attn.q_proj.bias" in tensors,
             "norm_before_residual": bool(cfg.get("norm_before_residual", False))}
    for key in ("intermediate_size", "num_key_value_heads"):
        if key in cfg and cfg[key] != sizes[key]:
            raise ModelError(f"head {path}: config.json {key} is {cfg[key]!r}, its weights say {sizes[key]}")
    rows = tensors["lm_head.weight"]
    if rows.shape[1] != hidden:
        raise ModelError(f"head {path}: lm_head.weight must be [draft vocabulary, {hidden}]")
    draft_vocab = None
    if "d2t" in tensors:
        d2t = tensors["d2t"].reshape(-1)
        ids = torch.arange(rows.shape[0]) + d2t.long() if len(d2t) == rows.shape[0] and not d2t.is_floating_point() else None
        if ids is None or ids.min() < 0 or ids.max() >= vocab_size or len(torch.unique(ids)) != len(ids):
            raise ModelError(f"head {path}: d2t does not map its {rows.shape[0]} draft tokens to distinct target ids "
                             f"in 0..{vocab_size - 1}")
        draft_vocab = None if len(ids) == vocab_size and torch.equal(ids, torch.arange(vocab_size)) else ids
    elif rows.shape[0] != vocab_size:
        raise ModelError(f"head {path}: {rows.shape[0]} LM head rows but no d2t map to the target's {vocab_size} tokens")
    head = Eagle3Head(target, sizes, draft_vocab, _eagle3_layers(path, cfg, target.config.num_hidden_layers))
    own = set(head_tensors(head)) - {"draft_vocab"}
    weights = {k: v.float() for k, v in tensors.items() if k in own}
    missing = sorted(own - set(weights))
    extra = sorted(set(tensors) - own - {"d2t", "t2d", "embed_tokens.weight"})
    shapes = [k for k, v in weights.items() if v.shape != head.state_dict()[k].shape]
    if missing or extra or shapes:
        raise ModelError(f"head {path}: EAGLE-3 weights do not match its config (missing {missing[:4]}, "
                         f"unexpected {extra[:4]}, wrong shape {shapes[:4]})")
    head.load_state_dict(weights, strict=False)
    return head.eval()
