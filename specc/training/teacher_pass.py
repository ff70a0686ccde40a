"""The teacher pass: one target forward pass per sequence for its features and next-token top-K, saved in
parts as it goes so that an interrupted run resumes."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

def empty_data(n: int, width: int, hidden: int, top_k: int) -> dict:
    return {"tokens": torch.zeros(n, width, dtype=torch.long), "valid": torch.zeros(n, width, dtype=torch.bool),
            "answer": torch.zeros(n, width, dtype=torch.bool), "features": torch.zeros(n, width, hidden, dtype=torch.float16),
            "top_val": torch.zeros(n, width, top_k, dtype=torch.float16),
            "top_idx": torch.zeros(n, width, top_k, dtype=torch.int32)}


@torch.no_grad()
def _features(model, seqs: list[tuple[list[int], int]], top_k: int, feature_layers: list[int] | None,
              bar: tqdm) -> dict:
    """The teacher pass over seqs, padded to their own longest (see teacher_pass)."""
    hidden = model.config.hidden_size * (len(feature_layers) if feature_layers else 1)
    data = empty_data(len(seqs), max(len(s) for s, _ in seqs), hidden, top_k)
    for i, (ids, n_prompt) in enumerate(seqs):
        t = len(ids)
        out = model.model(torch.tensor([ids]), output_hidden_states=bool(feature_layers))
        if feature_layers:
            feats = torch.cat([out.hidden_states[l + 1][0] for l in feature_layers], -1)
        else:
            feats = out.last_hidden_state[0]
        top = torch.topk(model.lm_head(out.last_hidden_state[0]).float(), top_k, -1)
        data["tokens"][i, :t] = torch.tensor(ids)
        data["valid"][i, :t] = True
        data["answer"][i, n_prompt:t] = True
        data["features"][i, :t] = feats.half()
        data["top_val"][i, :t] = top.values.half()
        data["top_idx"][i, :t] = top.indices.int()
        bar.update()
    return data


def _load_part(path: Path, seqs: list[tuple[list[int], int]], top_k: int, hidden: int) -> dict | None:
    """A saved part of the teacher pass, if it is one over exactly these sequences and shapes."""
    if not path.is_file():
        return None
    try:
        part = load_file(str(path))
        ok = (part["features"].shape[-1] == hidden and part["top_idx"].shape[-1] == top_k
              and len(part["tokens"]) == len(seqs)
              and all(part["tokens"][i, :len(ids)].tolist() == ids and int(part["valid"][i].sum()) == len(ids)
                      and int(part["answer"][i].sum()) == len(ids) - n for i, (ids, n) in enumerate(seqs)))
    except Exception:  # a file cut short by the interruption: computed again
        return None
    return part if ok else None


def teacher_pass(model, seqs: list[tuple[list[int], int]], top_k: int, feature_layers: list[int] | None = None,
                 parts: Path | None = None, chunk: int = 32, desc: str = "target features") -> dict:
    """tokens, valid and answer masks [N, T]; features [N, T, F] fp16 (post-norm last hidden state, or the
    given layers' outputs concatenated); the target's top-K next-token values/ids [N, T, K].

    With `parts` (a file name), every `chunk` sequences are saved beside it as they finish
    (`<parts stem>.teacher-<first>.safetensors`) and a later call over the same sequences reuses them:
    a long run survives an interruption."""
    hidden = model.config.hidden_size * (len(feature_layers) if feature_layers else 1)
    pieces = []
    with tqdm(total=len(seqs), desc=desc, unit="seq") as bar:
        for lo in range(0, len(seqs), chunk):
            group = seqs[lo:lo + chunk]
            path = parts.with_name(f"{parts.stem}.teacher-{lo:05d}.safetensors") if parts else None
            piece = _load_part(path, group, top_k, hidden) if path else None
            if piece is None:
                piece = _features(model, group, top_k, feature_layers, bar)
                if path:
                    save_file(piece, str(path.with_suffix(".partial")))
                    path.with_suffix(".partial").rename(path)
            else:
                bar.update(len(group))
            pieces.append(piece)
    width = max(len(s) for s, _ in seqs)
    return {k: torch.cat([torch.nn.functional.pad(p[k], (0, 0) * (p[k].dim() - 2) + (0, width - p[k].shape[1]))
                          for p in pieces]) for k in pieces[0]}
