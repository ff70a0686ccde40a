"""train-head checkpoints: the head's weights, draft vocabulary and optimizer state in safetensors, with the step,
kind and Medusa heads in the metadata; written as training goes and resumed from."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import SpeccError
from ..heads.medusa import MedusaHeads
from ..heads.store import head_tensors

def save_checkpoint(path: Path, head, opt, step: int, kind: str) -> None:
    tensors = {f"head.{k}": v for k, v in head_tensors(head).items() if k != "draft_vocab"}  # as save_head writes
    if head.vocab.draft_vocab is not None:
        tensors["draft_vocab"] = head.vocab.draft_vocab.contiguous()
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        st = opt.state.get(p)
        if st:
            tensors[f"opt.{i}.exp_avg"] = st["exp_avg"].contiguous()
            tensors[f"opt.{i}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
    meta = {"step": str(step), "kind": kind}
    if isinstance(head, MedusaHeads):
        meta["heads"] = str(head.n_heads)
    save_file(tensors, str(path.with_suffix(".partial")), metadata=meta)
    path.with_suffix(".partial").rename(path)


def checkpoint_facts(output: Path) -> dict | None:
    """What the checkpoint in output/ was trained as: its step, kind, Medusa heads and draft vocabulary size
    (None: not known before the target loads); from its metadata or, for checkpoints written before it held
    them, the saved head's config.json. None if output/ holds no checkpoint."""
    ckpt = output / "checkpoint.safetensors"
    if not ckpt.is_file():
        return None
    try:
        with safe_open(str(ckpt), "pt") as f:
            meta = f.metadata() or {}
            vocab = f.get_slice("draft_vocab").get_shape()[0] if "draft_vocab" in f.keys() else None
        step = int(meta["step"])
        kind, heads = meta.get("kind"), meta.get("heads")
        if kind is None and (output / "config.json").is_file():
            saved = json.loads((output / "config.json").read_text())
            kind = "eagle3" if saved.get("eagle3") else saved.get("kind")
            heads = saved.get("medusa_num_heads")
    except Exception as exc:  # safetensors and json raise several types for unreadable files
        raise SpeccError(f"{ckpt} is not a readable train-head checkpoint ({exc}); remove {output} to start "
                         "over") from None
    return {"step": step, "kind": kind, "heads": None if heads is None else int(heads), "draft_vocab": vocab}


def resume(path: Path, head, opt) -> int:
    facts = checkpoint_facts(path.parent)
    if facts is None:
        return 0
    step, tensors = facts["step"], load_file(str(path))
    want = {k: v.shape for k, v in head_tensors(head).items() if k != "draft_vocab"}
    got = {k[5:]: v.shape for k, v in tensors.items() if k.startswith("head.")}
    if got != want:
        odd = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise SpeccError(f"{path} does not hold this head's weights (differing: {', '.join(odd[:4])}); resume it "
                         f"with the settings it was trained with, or remove {path.parent} to start over")
    head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")}, strict=False)
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        if f"opt.{i}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": tensors[f"opt.{i}.exp_avg"],
                            "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
    return step


def saved_draft_vocab(output: Path) -> tuple[torch.Tensor | None, str] | None:
    """The draft vocabulary of the head being resumed in output/: its checkpoint's, or (checkpoints written
    before they kept it) the saved head's; None if there is no checkpoint to resume."""
    ckpt = output / "checkpoint.safetensors"
    if not ckpt.is_file():
        return None
    for path in (ckpt, output / "model.safetensors"):
        if path.is_file():
            with safe_open(str(path), "pt") as f:
                if "draft_vocab" in f.keys():
                    return f.get_tensor("draft_vocab"), path.name
    return None, ckpt.name
