"""Self-distillation data for draft heads, cached to disk in safetensors: the target's features at every
position of every sequence and its own next-token top-K there (the labels). `build_data` runs the phases
and merges what they give into one cached set.

Sequences come from one of two sources:
- answers: the target answers offline prompts greedily (prompt_corpora: standard-library function
  openings and a topic x template grid of chat instructions, or in sets with `chat="self"` user
  messages the target writes itself, self_questions). Closest to what the head sees at run time;
  costs one target step per generated token. The passes that answer record the labels as they go
  (answers.Recorder); answers journaled without them get a teacher pass.
- text: windows of the source of fixed standard-library modules (stdlib_sources), teacher-forced
  (teacher_pass): one batched pass per window, the cheap choice on a shared CPU.
A set cached for one kind's features (EAGLE-1/2's last layer, EAGLE-3's three) gives its answers to
the same set for the other: only the teacher pass runs again.
Positions where the sequence continues as the target's greedy choice (`answer`) are where
held-out acceptance can be measured.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .answers import generate
from .data_config import DTYPES, DataConfig
from .prompt_corpora import encode, training_prompts
from .self_questions import written_questions
from .stdlib_sources import text_windows
from .teacher_pass import empty_data, teacher_pass


def build_data(model, tokenizer, model_name: str, cfg: DataConfig, cache: Path,
               feature_layers: list[int] | None = None, label: str = "") -> tuple[dict, dict]:
    """The cached data set for (model, cfg), generating it on first use (progress bars prefixed with
    `label`, e.g. "set 2/3: "); returns (tensors, info)."""
    base = cfg.key(model_name)
    key = base + ("-l" + "-".join(map(str, feature_layers)) if feature_layers else "")
    path = cache / f"heads-data-{key}.safetensors"
    if path.is_file():
        return load_file(str(path)), {"cache": str(path), "reused": True}
    if cfg.dtype != "float32":  # a copy: the head keeps the float32 target's embedding and LM head rows
        model = copy.deepcopy(model).to(DTYPES[cfg.dtype])
    recorded: dict[int, dict] = {}
    sibling = _sibling_answers(path, base) if cfg.source == "answers" else None
    if cfg.source == "text":
        seqs = [(w, 0) for w in text_windows(tokenizer, cfg.n_code + cfg.n_chat, cfg.seq_len, cfg.code_from + cfg.chat_from)]
    elif sibling is not None:  # another kind's features over the same answers: only the teacher pass is new
        seqs = sibling[0]
    else:
        texts = training_prompts(cfg)
        if cfg.chat == "self":
            questions = written_questions(model, tokenizer, cfg, path.with_suffix(".questions.json"),
                                          f"{label}user messages")
            texts = [t for t in texts if not t[1]] + [(q, True) for q in questions]
        prompts = [encode(tokenizer, text, chat, cfg.max_prompt_tokens) for text, chat in texts]
        seqs, recorded = generate(model, tokenizer, prompts, cfg.new_tokens, cfg.batch, path.with_suffix(".answers.jsonl"),
                                  top_k=cfg.top_k, feature_layers=feature_layers, desc=f"{label}target answers")
    rest = [i for i in range(len(seqs)) if i not in recorded]  # answers journaled before recording, and text
    taught = (teacher_pass(model, [seqs[i] for i in rest], cfg.top_k, feature_layers, parts=path,
                           desc=f"{label}target features") if rest else None)
    data = _merge(seqs, recorded, rest, taught, cfg.top_k, model.config.hidden_size * max(1, len(feature_layers or [])))
    if cfg.source == "text":  # measurable where the text is what the target would have written
        argmax = data["top_idx"][..., 0].long()
        data["answer"][:, 1:] = (data["tokens"][:, 1:] == argmax[:, :-1]) & data["valid"][:, 1:]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    save_file({k: v.contiguous() for k, v in data.items()}, str(tmp))
    tmp.rename(path)
    path.with_suffix(".answers.jsonl").unlink(missing_ok=True)
    for part in [*cache.glob(f"{path.stem}.teacher-*"), *cache.glob(f"{path.stem}.answers.batch-*")]:
        part.unlink()
    info = {"cache": str(path), "reused": False}
    return data, (info | {"answers_from": str(sibling[1])} if sibling is not None else info)


def _merge(seqs: list[tuple[list[int], int]], recorded: dict[int, dict], rest: list[int], taught: dict | None,
           top_k: int, hidden: int) -> dict:
    """One data set in the sequences' order: recorded rows (their first `length` tokens) and the teacher
    pass's rows (`taught`, over seqs[rest])."""
    if not recorded:
        return taught
    lengths = [recorded[i]["length"] if i in recorded else len(seqs[i][0]) for i in range(len(seqs))]
    data = empty_data(len(seqs), max(lengths), hidden, top_k)
    for j, i in enumerate(rest):
        for k, v in taught.items():
            data[k][i, :v.shape[1]] = v[j]
    for i, rec in recorded.items():
        n, (ids, n_prompt) = rec["length"], seqs[i]
        data["tokens"][i, :n] = torch.tensor(ids[:n])
        data["valid"][i, :n] = True
        data["answer"][i, n_prompt:n] = True
        for k in ("features", "top_val", "top_idx"):
            data[k][i, :n] = rec[k]
    return data


def _sibling_answers(path: Path, key: str) -> tuple[list[tuple[list[int], int]], Path] | None:
    """The (tokens, prompt length) sequences of a cached set of the same prompts and settings whose features
    are of other layers (`key` with or without a "-l..." suffix; another --kind), and its path: the target's
    answers do not depend on which features are kept, so a new kind's data needs the teacher pass only."""
    for other in sorted(path.parent.glob(f"heads-data-{key}*.safetensors")):
        if other == path or "." in other.stem or not (other.stem == f"heads-data-{key}"
                                                      or other.stem.startswith(f"heads-data-{key}-l")):
            continue  # teacher-pass parts and answer records of an unfinished set (<stem>.teacher-<n>, ...)
        try:
            with safe_open(str(other), "pt") as f:
                tokens, valid, answer = (f.get_tensor(k) for k in ("tokens", "valid", "answer"))
        except Exception:  # unreadable or of another layout: answered again instead
            continue
        seqs = []
        for ids, v, a in zip(tokens, valid, answer):
            n = int(v.sum())
            seqs.append((ids[:n].tolist(), int(a.int().argmax()) if bool(a.any()) else n))
        return seqs, other
    return None
