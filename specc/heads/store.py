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
Pickled weights (.bin, .pt, .pth) are refused: loading them runs arbitrary code.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ModelError
from .eagle import EagleHead
from .medusa import MedusaHeads

KINDS = ("medusa", "eagle")
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
               draft_vocab: torch.Tensor | None = None, fc_bias: bool = True) -> torch.nn.Module:
    """A fresh (untrained) head of this kind for this target."""
    if kind == "medusa":
        cfg = target.config
        return MedusaHeads(cfg.hidden_size, n_heads, n_layers, target.lm_head.weight, cfg.vocab_size, draft_vocab,
                           shared_lm_head)
    if kind == "eagle":
        return EagleHead(target, draft_vocab, fc_bias)
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
    """A head from a specc, Medusa or EAGLE-1/2 directory, bound to the target; returns (module, config)."""
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
        else:
            head = build_head("eagle", target, draft_vocab=draft_vocab, fc_bias=cfg.get("fc_bias", True))
        _load_owned(head, tensors, path)
        return head.eval(), cfg
    if "medusa_num_heads" in cfg:
        return _import_medusa(path, cfg, target), {**cfg, "kind": "medusa", "imported": "medusa"}
    tensors = _read_tensors(path, ("model.safetensors", "pytorch_model.safetensors"))
    if any(k.startswith("midlayer.") for k in tensors):
        raise ModelError(f"head {path} is an EAGLE-3 checkpoint (midlayer.*, d2t); specc imports Medusa and EAGLE-1/2 "
                         "heads, not EAGLE-3 yet")
    if "fc.weight" in tensors:
        return _import_eagle(path, tensors, target), {**cfg, "kind": "eagle", "imported": "eagle"}
    raise ModelError(f"head {path}: config.json is neither a specc head, a Medusa head (medusa_num_heads) nor an "
                     "EAGLE head (weights with fc.weight and layers.0.*)")


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
