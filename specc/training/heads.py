"""`specc train-head`: train a Medusa or EAGLE head on the target's own outputs (CPU).

Data (heads/data.py) is cached once; training then reads only the cache. Losses:
- Medusa: head i at position j, cross-entropy against the target's (top-K, renormalised)
  next-token distribution at position j+1+i.
- EAGLE: at entry j = (f_j, x_{j+1}), smooth-L1 between the predicted and the target's feature
  f_{j+1} plus cross-entropy of the LM head on it against the target at j+1; then `unroll` - 1
  further draft steps fed the head's own predicted features, with the attention the runtime's
  draft steps have (training-time test). Gaussian noise on step 1's input features.
- EAGLE-3 (`eagle3`): the same unrolled steps over fc(low, middle and high layer features), with
  cross-entropy only (its output is not a target feature, so there is nothing to regress to).
Checkpoints (weights, draft vocabulary and optimizer state, safetensors) are written every
`checkpoint_every` steps and resumed from when the command runs again, also with more data sets
(prompts after those of the earlier sets) or more steps: the head keeps its draft vocabulary.
Every tenth sequence of each data set is held out. The held-out estimate is greedy: the
fraction of positions where the first i drafts all equal the target's argmax, measured by
drafting chains (EAGLE: autoregressively with its own cache) on answers the target wrote.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..errors import SpeccError
from ..capture.families import family_for
from ..heads.eagle import EagleBase, EagleHead
from ..heads.eagle3 import Eagle3Head, default_feature_layers
from ..heads.medusa import MedusaHeads
from ..heads.store import build_head, head_tensors, save_head
from .head_data import CHATS, DTYPES, DataConfig, build_data


@dataclass
class TrainConfig:
    kind: str
    steps: int = 600
    batch_seqs: int = 4
    lr: float | None = None  # None: default_lr(the target's hidden size)
    heads: int = 4  # medusa
    draft_vocab: int | None = 8192  # most frequent tokens of the data; None: the full vocabulary
    noise: float = 0.05  # eagle: feature noise, relative to the features' RMS
    unroll: int = 3  # eagle: draft steps trained per position (training-time test; 1: EAGLE-1's teacher forcing)
    eval_every: int = 100
    eval_depth: int = 5
    checkpoint_every: int = 100
    seed: int = 0
    dtype: str = "float32"  # the losses' matmuls: float32, or bfloat16 autocast (weights and optimizer stay float32)
    init: str = "random"  # eagle: "target" starts the head's layer as the target's last one (start_from_target)


ROUND_K = 3  # drafts per round of the card's greedy-run estimate (round_acceptance)


INITS = ("random", "target")


def start_from_target(head: EagleHead | Eagle3Head, target) -> None:
    """`--init target`: the head's decoder layer starts as the target's last one (attention, post-attention
    norm, MLP) and fc as [0 | I] without bias, passing the feature through: pretrained weights for a head
    trained on little data. Requires a layer of the head's names and shapes and norms without an offset.
    EAGLE-3 (`_start_eagle3`): the same layer over the highest fused layer's output."""
    if family_for(target.config).norm_offset:
        raise SpeccError(f"--init target: {target.config.model_type} norms scale by (1 + w), the head's by w; "
                         "allowed here: --init random")
    last = target.model.layers[-1].state_dict()
    if isinstance(head, Eagle3Head):
        _start_eagle3(head, last)
        return
    mine = head.layers[0].state_dict()
    missing = [k for k in mine if k not in last or last[k].shape != mine[k].shape]
    if missing:
        raise SpeccError(f"--init target: the target's last layer has no {', '.join(missing)} of the head's shape; "
                         "allowed here: --init random")
    head.layers[0].load_state_dict({k: last[k] for k in mine})
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, head.hidden:] = torch.eye(head.hidden)
        if head.fc.bias is not None:
            head.fc.bias.zero_()


def _start_eagle3(head: Eagle3Head, last: dict[str, torch.Tensor]) -> None:
    """EAGLE-3's midlayer as the target's last layer reading the fused feature: hidden_norm is that layer's
    input norm, q/k/v its projections on the feature's half of the [embedding; feature] input (zero on the
    embedding's half), and fc passes the highest fused layer's output through, so the head starts as the
    target's last layer applied to that layer's output (the residual stream a decoder layer reads)."""
    mine, new = head.midlayer.state_dict(), {}
    for name, value in mine.items():
        if name.startswith("input_layernorm."):  # the embedding's norm: the target has none to copy
            continue
        source = last.get(name.replace("hidden_norm.", "input_layernorm."))
        if source is not None and name.split(".")[1] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
            source = torch.cat([torch.zeros_like(source), source], 1)
        if source is None or source.shape != value.shape:
            raise SpeccError(f"--init target: the target's last layer has no {name} of the EAGLE-3 head's shape; "
                             "allowed here: --init random")
        new[name] = source
    head.midlayer.load_state_dict(new, strict=False)
    high = max(range(len(head.feature_layers)), key=lambda i: head.feature_layers[i])
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, high * head.hidden:(high + 1) * head.hidden] = torch.eye(head.hidden)


def default_lr(hidden: int) -> float:
    """AdamW's peak learning rate for a head over features `hidden` wide: 1e-3 up to 1024 (SmolLM2-135M's
    heads, 576 wide, trained well at it), 3e-4 above. Measured on Qwen2.5-Coder-1.5B (1536 wide, EAGLE,
    150 steps): 1e-3 stalled at held-out cross-entropy 5.2-5.6 and then rose, 3e-4 reached 3.96, 1e-4 4.16."""
    return 1e-3 if hidden <= 1024 else 3e-4


def draft_vocabulary(data: dict, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent target argmax tokens in the data (ties by id), sorted; None for the full vocabulary."""
    if size is None or size >= vocab_size:
        return None
    top1 = data["top_idx"][..., 0][data["valid"]].long()
    counts = torch.bincount(torch.cat([top1, data["tokens"][data["valid"]]]), minlength=vocab_size).float()
    counts += torch.arange(vocab_size, 0, -1).float() / vocab_size / 2  # deterministic tie-break
    return torch.sort(torch.topk(counts, size).indices).values


def soft_targets(top_val, top_idx, to_draft: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised top-K target probabilities over draft-vocabulary indices (-1 marks tokens outside it)."""
    p = torch.softmax(top_val.float(), -1)
    idx = top_idx.long() if to_draft is None else to_draft[top_idx.long()]
    p = torch.where(idx >= 0, p, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return p, idx.clamp_min(0)


def _ce(logits, p, idx, mask) -> torch.Tensor:
    logq = torch.log_softmax(logits.float(), -1).gather(-1, idx)
    loss = -(p * logq).sum(-1)
    return (loss * mask).sum() / mask.sum().clamp_min(1)


def medusa_loss(head: MedusaHeads, batch: dict, to_draft) -> torch.Tensor:
    feats = batch["features"].float()
    logits = head.reduced_logits(feats)  # [b, T, N, V']
    total = 0.0
    for i in range(head.n_heads):
        shift = 1 + i
        p, idx = soft_targets(batch["top_val"][:, shift:], batch["top_idx"][:, shift:], to_draft)
        mask = (batch["valid"][:, shift:] & batch["valid"][:, :-shift]).float()
        total = total + _ce(logits[:, :-shift, i], p, idx, mask)
    return total / head.n_heads


def eagle_unroll(head: EagleBase, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs of `steps` draft steps from every position at once: out[s][:, o] [B, T-1-s, H]
    predicts the feature s + 1 tokens after o, drafting from round o (training-time test, as in HASS
    and EAGLE-3).

    Step 1 at entry o = (x_{o+1}, f_o) sees entries 0..o, as when a round enters the committed
    tokens. Step s > 1 is drafting as the runtime drafts: its entry (x_{o+s}, h) at position o+s-1
    feeds the head's own output h of step s-1 at o and attends to the true entries 0..o and to round
    o's earlier draft entries only."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    eye = torch.eye(t, dtype=torch.bool)
    keys, values, out, f_in = [], [], [], features[:, :t]
    for s in range(min(steps, t)):
        n = t - s  # rounds o = 0..n-1 have a target s + 1 tokens on
        mask = torch.cat([causal[:n, :n]] + [eye[:n, :n]] * s, dim=-1)  # true entries <= o, then round o's own
        if keys:
            k_cache, v_cache = (torch.cat([x[:, :, :n] for x in kv], dim=2) for kv in (keys, values))
        else:
            k_cache = v_cache = head.empty_cache(b)[0]
        h, k, v = head.layer_step(tokens[:, 1 + s:], f_in[:, :n], torch.arange(s, s + n)[None].expand(b, n),
                                  mask[None].expand(b, -1, -1), k_cache, v_cache)
        keys.append(k)
        values.append(v)
        out.append(h)
        f_in = h
    return out


def eagle_loss(head: EagleBase, batch: dict, to_draft, noise: float, unroll: int = 1) -> torch.Tensor:
    """Per draft step of `eagle_unroll`: smooth-L1 to the target's feature (EAGLE-1/2 only) + 0.5 x
    cross-entropy against its distribution, step s weighted 0.8^(s-1); Gaussian noise on step 1's input
    features (EAGLE-3: on the layers' features, before fc)."""
    feats = batch["features"].float()
    f_in = feats[:, :-1]
    if noise:
        f_in = f_in + torch.randn_like(f_in) * noise * f_in.pow(2).mean().sqrt()
    fused = isinstance(head, Eagle3Head)
    total, weight = 0.0, 0.0
    for s, h in enumerate(eagle_unroll(head, batch["tokens"], head.fc(f_in) if fused else f_in, unroll)):
        m = batch["valid"][:, 1 + s:].float()
        loss = 0.0 if fused else (F.smooth_l1_loss(h.float(), feats[:, 1 + s:], reduction="none").mean(-1) * m).sum() / m.sum().clamp_min(1)
        p, idx = soft_targets(batch["top_val"][:, 1 + s:], batch["top_idx"][:, 1 + s:], to_draft)
        total = total + 0.8 ** s * (loss + 0.5 * _ce(head.reduced_logits(h), p, idx, m))
        weight += 0.8 ** s
    return total / weight


@torch.no_grad()
def acceptance(head, data: dict, rows: torch.Tensor, depth: int, starts: int = 6) -> list[float]:
    """Greedy acceptance by draft position on held-out sequences: P(drafts 1..i all equal the target argmax).

    A round starting at o: the target has processed x_0..x_o and x_{o+1} is pending; draft i stands
    for x_{o+1+i} and must equal the target's argmax at o+i. That argmax was computed on the data's
    context, so rounds start only where the data continues as the target's greedy choice for the
    next depth-1 tokens (`answer`; every position of a generated answer).
    """
    hits, total = torch.zeros(depth), 0
    argmax = data["top_idx"][..., 0].long()
    for r in rows.tolist():
        n = int(data["valid"][r].sum())
        ok = data["answer"][r, :n].long()
        if n < depth + 3:
            continue
        span = ok[2:].unfold(0, depth - 1, 1).prod(-1) if depth > 1 else ok[2:]
        candidates = [o for o in span.nonzero()[:, 0].tolist() if o + depth < n]
        chosen = candidates[::max(1, len(candidates) // starts)][:starts]
        if not chosen:
            continue
        drafts = _drafter(head, data, r, max(chosen) + 1)
        for o in chosen:
            target = argmax[r, o + 1:o + 1 + depth]
            drafted = drafts(o, depth)
            hit = (drafted == target[:len(drafted)]).long().cumprod(-1)
            hits[:len(hit)] += hit.float()
            total += 1
    return (hits / max(total, 1)).tolist()


@torch.no_grad()
def round_acceptance(head, data: dict, rows: torch.Tensor, k: int) -> tuple[list[float], int]:
    """Greedy acceptance by draft position in chain rounds of k drafts over the answers, as a greedy
    run counts it (the bench's `acceptance_by_position`): the first round starts where the answer
    does, each next one after the accepted drafts and the target's own token. Rounds start after a
    miss more often than spaced positions do, so this is below `acceptance` (the Qwen EAGLE head of
    stop 37: 0.25 against 0.31 on the benchmark prompts, and 0.25 in the benchmark). Returns
    (acceptance by position, rounds)."""
    argmax = data["top_idx"][..., 0].long()
    hits, rounds = torch.zeros(k), 0
    for r in rows.tolist():
        n = int(data["valid"][r].sum())
        o = n - int(data["answer"][r, :n].sum()) - 1  # the prompt's last position: its next token is the answer's first
        if o < 0 or o + k >= n:
            continue
        drafts = _drafter(head, data, r, n - k)
        while o + k < n:  # the target's argmax is known up to position n - 1
            hit = (drafts(o, k) == argmax[r, o + 1:o + 1 + k]).long().cumprod(-1)
            hits += hit.float()
            rounds += 1
            o += int(hit.sum()) + 1
    return (hits / max(rounds, 1)).tolist(), rounds


def _drafter(head, data: dict, r: int, n: int):
    """draft(o, k): the head's k greedy drafts for a round of row r starting at o < n."""
    if isinstance(head, MedusaHeads):
        return lambda o, k: head(data["features"][r, o].float())[:k].argmax(-1)
    entered = _eagle_enter(head, data, r, n)
    return lambda o, k: _eagle_chain(head, entered, o, k)


def _eagle_enter(head: EagleBase, data: dict, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r's first n true entries (x_{j+1}, f_j) in one pass: outputs [1, n, H] and KV ([1, 1, H_kv, n, D]).
    Entry o's output and the cache up to it are what a round starting at o has (attention is causal)."""
    feats = data["features"][r:r + 1, :n].float()
    if isinstance(head, Eagle3Head):  # the target graph fuses them (passes/add_feature_outputs.py)
        feats = head.fc(feats)
    empty = head.empty_cache(1)
    return head.run(data["tokens"][r:r + 1, 1:n + 1], feats, torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                    empty, empty)


def _eagle_chain(head: EagleBase, entered: tuple, o: int, depth: int) -> torch.Tensor:
    """Draft `depth` tokens autoregressively from round o with the head's own cache, as the runtime does."""
    h, k, v = entered[0][:, o:o + 1], entered[1][..., :o + 1, :], entered[2][..., :o + 1, :]
    logits = head.vocab(head.reduced_logits(h))
    out = []
    for i in range(depth):
        tok = logits[:, 0].argmax(-1)
        out.append(tok)
        if i + 1 == depth:
            break
        logits, h, nk, nv = head(tok[:, None], h[:, -1:], torch.tensor([[o + 1 + i]]), torch.tensor([k.shape[3]]),
                                 torch.zeros(1, 1, dtype=torch.long), k, v)
        k, v = torch.cat([k, nk], 3), torch.cat([v, nv], 3)
    return torch.cat(out)


def _checkpoint(path: Path, head, opt, step: int, kind: str) -> None:
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


def _resume(path: Path, head, opt) -> int:
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


def concat_data(parts: list[dict]) -> dict:
    """Data sets [N_i, T_i, ...] as one [sum N_i, max T_i, ...], zero-padded (padding is not `valid`)."""
    width = max(p["tokens"].shape[1] for p in parts)
    return {k: torch.cat([F.pad(p[k], (0, 0) * (p[k].dim() - 2) + (0, width - p[k].shape[1])) for p in parts])
            for k in parts[0]}


def consecutive_sets(counts: list[int | tuple[int, str]], **fields) -> list[DataConfig]:
    """One DataConfig per count (or (count, chat prompts): "grid" or "self"): half code and half chat
    prompts (text: windows), each set starting after the prompts of the sets before it."""
    sets, code, chat = [], 0, 0
    for n in counts:
        n, kind = n if isinstance(n, tuple) else (n, "grid")
        sets.append(DataConfig(n_code=n // 2, n_chat=n - n // 2, code_from=code, chat_from=chat, chat=kind, **fields))
        code, chat = code + n // 2, chat + n - n // 2
    return sets


def check_train_config(cfg: TrainConfig, data_cfgs: list[DataConfig], output: Path) -> None:
    """Refuse, with one clear error, settings train_head could not use for the head in output/: before any
    model is loaded or data built."""
    if cfg.kind not in ("medusa", "eagle", "eagle3"):
        raise SpeccError(f"--kind {cfg.kind!r}: allowed medusa, eagle, eagle3")
    if cfg.dtype not in DTYPES or any(d.dtype not in DTYPES for d in data_cfgs):
        raise SpeccError(f"--dtype {cfg.dtype!r}: allowed {', '.join(DTYPES)}")
    if not data_cfgs or any(d.n_code < 0 or d.n_chat < 0 or d.n_code + d.n_chat < 1 for d in data_cfgs):
        raise SpeccError(f"--num-prompts {[d.n_code + d.n_chat for d in data_cfgs]}: allowed one or more counts >= 1")
    for d in data_cfgs:
        if d.chat not in CHATS or (d.chat == "self" and d.source != "answers"):
            raise SpeccError(f"--num-prompts {d.n_code + d.n_chat}:{d.chat} with --source {d.source}: allowed N (chat "
                             "prompts from the topic x template grid) or N:self (user messages the target writes "
                             "itself; --source answers)")
    if not isinstance(cfg.unroll, int) or cfg.unroll < 1:
        raise SpeccError(f"--unroll {cfg.unroll!r}: allowed an integer >= 1 (draft steps trained per position)")
    if cfg.lr is not None and not (isinstance(cfg.lr, float) and 0 < cfg.lr < 1):
        raise SpeccError(f"--lr {cfg.lr!r}: allowed a number between 0 and 1 (AdamW's peak learning rate)")
    if cfg.init not in INITS or (cfg.init == "target" and cfg.kind == "medusa"):
        raise SpeccError(f"--init {cfg.init!r} with --kind {cfg.kind}: allowed random, or target with --kind eagle "
                         "or eagle3")
    for flag, value, least, what in (("--steps", cfg.steps, 1, "training steps in all, resumed ones included"),
                                     ("--batch-seqs", cfg.batch_seqs, 1, "sequences per step"),
                                     ("--eval-every", cfg.eval_every, 1, "steps between held-out estimates"),
                                     ("--heads", cfg.heads, 1, "Medusa heads"),
                                     ("--draft-vocab", cfg.draft_vocab or 0, 0, "tokens; 0: the full vocabulary"),
                                     ("--new-tokens", min(d.new_tokens for d in data_cfgs), 1,
                                      "tokens the target writes per answer")):
        if not isinstance(value, int) or value < least:
            raise SpeccError(f"{flag} {value!r}: allowed an integer >= {least} ({what})")
    if output.exists() and not output.is_dir():
        raise SpeccError(f"-o {output}: a file; allowed a new directory, or one holding a head to resume")
    facts = checkpoint_facts(output)
    if facts is None:
        if output.is_dir() and any(output.iterdir()):
            raise SpeccError(f"-o {output}: holds files but no train-head checkpoint to resume (its files would be "
                             "overwritten); allowed a new or empty directory, or one holding a head to resume")
        return
    if facts["kind"] is not None and facts["kind"] != cfg.kind:
        raise SpeccError(f"--kind {cfg.kind}: the head in {output} was trained with --kind {facts['kind']}; allowed "
                         f"--kind {facts['kind']} to resume it, or another -o")
    if cfg.kind == "medusa" and facts["heads"] is not None and facts["heads"] != cfg.heads:
        raise SpeccError(f"--heads {cfg.heads}: the head in {output} has {facts['heads']} Medusa heads; allowed "
                         f"--heads {facts['heads']} to resume it, or another -o")
    if facts["draft_vocab"] is not None and facts["draft_vocab"] != cfg.draft_vocab:
        raise SpeccError(f"--draft-vocab {cfg.draft_vocab or 0}: the head in {output} has a draft vocabulary of "
                         f"{facts['draft_vocab']} tokens; allowed --draft-vocab {facts['draft_vocab']} to resume it, "
                         "or another -o")
    if facts["step"] > cfg.steps:
        raise SpeccError(f"--steps {cfg.steps}: the head in {output} has trained {facts['step']} steps already; "
                         f"allowed --steps >= {facts['step']} (the total, resumed steps included), or remove {output} "
                         "to start over")


def train_head(model, tokenizer, model_name: str, cfg: TrainConfig, data_cfgs: list[DataConfig], output: Path,
               cache: Path, progress: bool = True) -> tuple[torch.nn.Module, dict]:
    """Train (or resume) a head on the data sets `data_cfgs` together; writes output/ (config, weights,
    card) and returns (head, card)."""
    check_train_config(cfg, data_cfgs, output)
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    t0 = time.perf_counter()
    layers = default_feature_layers(model.config.num_hidden_layers) if cfg.kind == "eagle3" else None
    resumed_vocab = saved_draft_vocab(output)
    if resumed_vocab is not None:
        size = None if resumed_vocab[0] is None else len(resumed_vocab[0])
        if size != cfg.draft_vocab and not (size is None and (cfg.draft_vocab or 0) >= model.config.vocab_size):
            raise SpeccError(f"--draft-vocab {cfg.draft_vocab or 0}: the head resumed from {output / resumed_vocab[1]} has a "
                             f"draft vocabulary of {size or 'all'} tokens; pass that, or remove {output} to start over")
    parts, infos = [], []
    for i, d in enumerate(data_cfgs, 1):
        label = f"set {i}/{len(data_cfgs)}: " if len(data_cfgs) > 1 else ""
        part, info = build_data(model, tokenizer, model_name, d, cache, list(layers) if layers else None, label)
        parts.append(part)
        infos.append({**asdict(d), **info, "sequences": part["tokens"].shape[0]})
    data = concat_data(parts)
    data_seconds = time.perf_counter() - t0
    n = data["tokens"].shape[0]
    if n < 4:
        raise SpeccError(f"only {n} training sequences; raise --num-prompts")
    in_set = torch.cat([torch.arange(p["tokens"].shape[0]) for p in parts])
    held = torch.arange(n)[in_set % 10 == 9]  # every tenth sequence of each set is held out
    train = torch.arange(n)[in_set % 10 != 9]
    vocab_size = model.config.vocab_size
    if resumed_vocab is not None:  # the checkpoint's weights are rows of this vocabulary
        draft_vocab = resumed_vocab[0]
    else:
        draft_vocab = draft_vocabulary({k: data[k][train] for k in ("top_idx", "valid", "tokens")}, cfg.draft_vocab, vocab_size)
    to_draft = None
    if draft_vocab is not None:
        to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab))
    head = build_head(cfg.kind, model, n_heads=cfg.heads, draft_vocab=draft_vocab, feature_layers=layers)
    if cfg.init == "target":
        start_from_target(head, model)  # a resumed checkpoint's weights replace these below
    params = [p for p in head.parameters() if p.requires_grad and p.data_ptr() not in
              {q.data_ptr() for q in model.parameters()}]
    if cfg.lr is None:
        cfg = replace(cfg, lr=default_lr(model.config.hidden_size))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    output.mkdir(parents=True, exist_ok=True)
    ckpt = output / "checkpoint.safetensors"
    start = _resume(ckpt, head, opt)
    def lr_scale(s: int) -> float:  # warm-up then cosine; s counts from the resumed step
        s += start
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    gen = torch.Generator().manual_seed(cfg.seed + start)
    before = acceptance(head.eval(), data, held, cfg.eval_depth)
    head.train()
    losses, estimate = [], before
    t1 = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=f"train {cfg.kind}", unit="step", disable=not progress, initial=start, total=cfg.steps)
    for step in bar:
        pick = train[torch.randint(0, len(train), (cfg.batch_seqs,), generator=gen)]
        width = int(data["valid"][pick].sum(-1).max())
        batch = {k: v[pick, :width] for k, v in data.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            loss = (medusa_loss(head, batch, to_draft) if cfg.kind == "medusa"
                    else eagle_loss(head, batch, to_draft, cfg.noise, cfg.unroll))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            estimate = acceptance(head.eval(), data, held, cfg.eval_depth)
            head.train()
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            _checkpoint(ckpt, head, opt, step + 1, cfg.kind)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        held_out_accept=",".join(f"{a:.2f}" for a in estimate[:4]))
    head.eval()
    after = acceptance(head, data, held, cfg.eval_depth)
    in_rounds, n_rounds = round_acceptance(head, data, held, ROUND_K)
    coverage = None
    if to_draft is not None:
        am = data["top_idx"][held][..., 0].long()[data["valid"][held]]
        coverage = (to_draft[am] >= 0).float().mean().item()
    card = {
        "kind": cfg.kind, "target": model_name, "train": asdict(cfg),
        "data": {**(infos[0] if len(infos) == 1 else {"sets": infos}), "reused": all(i["reused"] for i in infos),
                 "sequences": n, "train_sequences": len(train), "held_out_sequences": len(held),
                 "tokens": int(data["valid"].sum()), "answer_tokens": int(data["answer"].sum()),
                 "prompts": "stdlib function openings (modules outside the benchmark set) and chat instructions "
                            "(templated; sets with chat 'self': user messages the target wrote itself)",
                 "seconds": round(data_seconds, 1)},
        "draft_vocab_from": None if resumed_vocab is None else str(output / resumed_vocab[1]),
        "steps": cfg.steps, "resumed_from_step": start, "train_seconds": round(time.perf_counter() - t1, 1),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
        "draft_vocab_size": None if draft_vocab is None else len(draft_vocab),
        "draft_vocab_coverage_of_target_argmax": coverage,
        "held_out": {"greedy_acceptance_by_position_before": before, "greedy_acceptance_by_position": after,
                     "top1_agreement": after[0], "expected_accepted_per_round": sum(after),
                     f"round_acceptance_by_position_k{ROUND_K}": in_rounds, "rounds": n_rounds,
                     f"tokens_per_target_pass_k{ROUND_K}": 1 + sum(in_rounds)},
    }
    save_head(output, head, model, card)
    return head, card
