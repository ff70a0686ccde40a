"""The target answers prompts greedily, batch by batch, journaled to disk so that an interrupted run resumes
where it stopped; a `Recorder` keeps the teacher pass's data of each batch as the answer is generated."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .generation import contiguous_lm_head, left_padded, pad_id

def _journal_line(batch: int, index: int, seq: list[int], n_prompt: int) -> str:
    return json.dumps({"batch": batch, "index": index, "ids": seq, "prompt_len": n_prompt}) + "\n"


def _journal_rows(journal: Path | None, prompts: list[list[int]],
                  batches: list[list[int]]) -> dict[int, tuple[list[int], int]]:
    """The answers an interrupted run wrote, by prompt index: whole batches that are batches of this run,
    over these prompts."""
    groups: dict[int, list] = {}
    if journal is not None and journal.is_file():
        for line in journal.read_text().splitlines():
            try:
                row = json.loads(line)
                entry = int(row["index"]), [int(t) for t in row["ids"]], int(row["prompt_len"])
                groups.setdefault(int(row["batch"]), []).append(entry)
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by the interruption: that batch is answered again
    out = {}
    for j, group in groups.items():
        if (0 <= j < len(batches) and [i for i, _, _ in group] == batches[j]
                and all(n == len(prompts[i]) and ids[:n] == prompts[i] for i, ids, n in group)):
            out.update({i: (ids, n) for i, ids, n in group})
    return out


class Recorder:
    """Forward hooks that keep, while `model.generate` answers a batch, what the teacher pass would compute
    for it: every position's feature (the final norm's output, or the given layers' outputs concatenated)
    and the target's top-K next-token logits (from the LM head's own output where generate computes it,
    the prompt's other positions through the LM head once more, in row chunks)."""

    LOGIT_ROWS = 512  # rows of the extra LM-head pass at once: bounds the logits held in memory

    def __init__(self, model, top_k: int, feature_layers: list[int] | None = None):
        self.model, self.top_k, self.calls, self.layer_out = model, top_k, [], {}
        self.hooks = [model.model.norm.register_forward_hook(self._norm),
                      model.lm_head.register_forward_hook(self._logits)]
        self.layers = list(feature_layers or [])
        for i in sorted(set(self.layers)):
            self.hooks.append(model.model.layers[i].register_forward_hook(self._layer(i)))

    def _layer(self, i: int):
        def keep(_module, _args, out) -> None:
            self.layer_out[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return keep

    def _norm(self, _module, _args, out) -> None:  # after every layer of this forward call
        out = out.detach()
        feats = torch.cat([self.layer_out[i] for i in self.layers], -1) if self.layers else out
        self.calls.append({"hidden": out, "features": feats})

    def _logits(self, _module, _args, out) -> None:
        top = torch.topk(out.detach().float(), self.top_k, -1)
        self.calls[-1]["top"] = (top.values, top.indices)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    @torch.no_grad()
    def rows(self, group: list[list[int]], answers: list[list[int]], width: int) -> list[dict] | None:
        """Per prompt of the batch: the data of its first L positions (prompt + the answer tokens generate
        fed back; an answer cut by the token limit loses its last token, whose pass never ran); None if
        the calls are not one prompt pass and then one-token steps (the teacher pass computes the batch)."""
        calls, self.calls = self.calls, []
        if (not calls or calls[0]["hidden"].shape[1] != width or any(c["hidden"].shape[1] != 1 for c in calls[1:])
                or any("top" not in c or c["top"][0].shape[1] > c["hidden"].shape[1] for c in calls)):
            return None
        prompt, steps = calls[0], len(calls) - 1
        known = prompt["top"][0].shape[1]  # the prompt positions whose logits generate computed (the last ones)
        vals, idx = [], []
        step = max(1, self.LOGIT_ROWS // len(group))  # the others, a few hundred logit rows at a time
        for lo in range(0, width - known, step):
            hi = min(width - known, lo + step)
            head = self.model.lm_head  # called as a function: its hook records generate's own calls
            logits = torch.nn.functional.linear(prompt["hidden"][:, lo:hi], head.weight, head.bias)
            top = torch.topk(logits.float(), self.top_k, -1)
            vals.append(top.values)
            idx.append(top.indices)
        top_val = torch.cat(vals + [prompt["top"][0]] + [c["top"][0] for c in calls[1:]], 1)
        top_idx = torch.cat(idx + [prompt["top"][1]] + [c["top"][1] for c in calls[1:]], 1)
        hidden = torch.cat([c["features"] for c in calls], 1)
        out = []
        for r, (p, answer) in enumerate(zip(group, answers)):
            pad, n = width - len(p), len(p) + min(len(answer), steps)
            out.append({"length": n, "features": hidden[r, pad:pad + n].half(),
                        "top_val": top_val[r, pad:pad + n].half(), "top_idx": top_idx[r, pad:pad + n].int()})
        return out


def _record_path(journal: Path | None, batch: int) -> Path | None:
    return journal.with_name(f"{journal.stem}.batch-{batch:05d}.safetensors") if journal is not None else None


def _save_record(path: Path, indices: list[int], rows: list[dict]) -> None:
    width = max(r["length"] for r in rows)
    tensors = {"index": torch.tensor(indices), "length": torch.tensor([r["length"] for r in rows])}
    for k in ("features", "top_val", "top_idx"):
        tensors[k] = torch.stack([torch.nn.functional.pad(r[k], (0, 0, 0, width - r["length"])) for r in rows])
    save_file(tensors, str(path.with_suffix(".partial")))
    path.with_suffix(".partial").rename(path)


def _load_record(path: Path | None, indices: list[int], rows: dict, top_k: int, hidden: int) -> dict[int, dict]:
    """A batch's recorded data, if it was saved for exactly these prompts and answers; else nothing."""
    if path is None or not path.is_file():
        return {}
    try:
        t = load_file(str(path))
        ok = (t["index"].tolist() == indices and t["features"].shape[-1] == hidden and t["top_idx"].shape[-1] == top_k
              and all(rows[i][1] <= n <= len(rows[i][0]) for i, n in zip(indices, t["length"].tolist())))
    except Exception:  # a file cut short by the interruption: the teacher pass computes the batch
        return {}
    if not ok:
        return {}
    return {i: {"length": n, **{k: t[k][r, :n] for k in ("features", "top_val", "top_idx")}}
            for r, (i, n) in enumerate(zip(indices, t["length"].tolist()))}


def generate(model, tokenizer, prompts: list[list[int]], new_tokens: int, batch: int, journal: Path | None = None,
             top_k: int | None = None, feature_layers: list[int] | None = None,
             desc: str = "target answers") -> tuple[list[tuple[list[int], int]], dict[int, dict]]:
    """Greedy continuations by the target itself: (prompt + answer ids, prompt length) per prompt, in the
    prompts' order. Batches hold prompts of similar length (sorted), so little of a batch is padding.

    With `top_k`, the passes that answer also record the data of the teacher pass (`Recorder`, with its
    `feature_layers`): returned by prompt index as {length, features, top_val, top_idx}, for the first
    `length` tokens of its sequence.

    With a journal, every finished batch is appended to it (and its record saved beside it) and a later call
    with the same prompts starts after the batches it holds (a long run survives an interruption; the
    batches are the same, so the answers are those of an uninterrupted run)."""
    pad = pad_id(tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    batches = [order[lo:lo + batch] for lo in range(0, len(order), batch)]
    rows = _journal_rows(journal, prompts, batches)
    todo = [j for j, b in enumerate(batches) if not all(i in rows for i in b)]
    recorded: dict[int, dict] = {}
    if journal is not None:
        journal.parent.mkdir(parents=True, exist_ok=True)
        journal.write_text("".join(_journal_line(j, i, *rows[i]) for j, b in enumerate(batches) if j not in todo
                                   for i in b))
        if top_k is not None:
            for j, b in enumerate(batches):
                if j not in todo:
                    recorded.update(_load_record(_record_path(journal, j), b, rows, top_k,
                                                 model.config.hidden_size * max(1, len(feature_layers or []))))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    recorder = Recorder(model, top_k, feature_layers) if top_k is not None and hasattr(model.model, "norm") else None
    try:
        with contiguous_lm_head(model):
            for j in tqdm(todo, desc=desc, unit="batch", initial=len(batches) - len(todo), total=len(batches)):
                group = [prompts[i] for i in batches[j]]
                ids, mask = left_padded(group, pad)
                width = ids.shape[1]
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=pad)
                answers = []
                for i, p, row in zip(batches[j], group, gen[:, width:].tolist()):
                    answer = []
                    for t in row:
                        if t in eos:
                            break
                        answer.append(t)
                    rows[i] = (p + answer, len(p))
                    answers.append(answer)
                record = recorder.rows(group, answers, width) if recorder else None
                if record is not None:
                    recorded.update(dict(zip(batches[j], record)))
                    if journal is not None:
                        _save_record(_record_path(journal, j), batches[j], record)
                if journal is not None:
                    with journal.open("a") as f:
                        f.writelines(_journal_line(j, i, *rows[i]) for i in batches[j])
    finally:
        if recorder:
            recorder.remove()
    return [rows[i] for i in range(len(prompts))], recorded
