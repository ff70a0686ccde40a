"""`specc train-head`: train a Medusa or EAGLE head on the target's own outputs (CPU).

Data (head_data.py) is cached once; training then reads only the cache. Losses (losses.py):
- Medusa: head i at position j, cross-entropy against the target's (top-K, renormalised)
  next-token distribution at position j+1+i.
- EAGLE: at entry j = (f_j, x_{j+1}), smooth-L1 between the predicted and the target's feature
  f_{j+1} plus cross-entropy of the LM head on it against the target at j+1; then `unroll` - 1
  further draft steps fed the head's own predicted features, with the attention the runtime's
  draft steps have (training-time test). Gaussian noise on step 1's input features.
- EAGLE-3 (`eagle3`): the same unrolled steps over fc(low, middle and high layer features), with
  cross-entropy only (its output is not a target feature, so there is nothing to regress to).
Checkpoints (checkpoints.py: weights, draft vocabulary and optimizer state) are written every
`checkpoint_every` steps and resumed from when the command runs again, also with more data sets
(prompts after those of the earlier sets) or more steps: the head keeps its draft vocabulary.
Every tenth sequence of each data set is held out. The held-out estimate (held_out.py) is greedy: the
fraction of positions where the first i drafts all equal the target's argmax, measured by
drafting chains (EAGLE: autoregressively with its own cache) on answers the target wrote.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import SpeccError
from ..heads.eagle3 import default_feature_layers
from ..heads.store import build_head, save_head
from .checkpoints import checkpoint_facts, resume, save_checkpoint, saved_draft_vocab
from .data_config import CHATS, DTYPES, DataConfig
from .head_data import build_data
from .head_init import INITS, start_from_target
from .held_out import acceptance, round_acceptance
from .losses import eagle_loss, medusa_loss

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


def default_lr(hidden: int) -> float:
    """AdamW's peak learning rate for a head over features `hidden` wide: 1e-3 up to 1024, 3e-4 above (wider
    heads stalled and then diverged at 1e-3; docs/heads.md)."""
    return 1e-3 if hidden <= 1024 else 3e-4


def draft_vocabulary(data: dict, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent target argmax tokens in the data (ties by id), sorted; None for the full vocabulary."""
    if size is None or size >= vocab_size:
        return None
    top1 = data["top_idx"][..., 0][data["valid"]].long()
    counts = torch.bincount(torch.cat([top1, data["tokens"][data["valid"]]]), minlength=vocab_size).float()
    counts += torch.arange(vocab_size, 0, -1).float() / vocab_size / 2  # deterministic tie-break
    return torch.sort(torch.topk(counts, size).indices).values


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


def _training_data(model, tokenizer, model_name: str, data_cfgs: list[DataConfig], cache: Path,
                   layers) -> tuple[dict, list[dict], torch.Tensor, torch.Tensor]:
    """The data sets' sequences together, what each set was, and the held-out and training sequence indices
    (every tenth sequence of each set is held out)."""
    parts, infos = [], []
    for i, d in enumerate(data_cfgs, 1):
        label = f"set {i}/{len(data_cfgs)}: " if len(data_cfgs) > 1 else ""
        part, info = build_data(model, tokenizer, model_name, d, cache, list(layers) if layers else None, label)
        parts.append(part)
        infos.append({**asdict(d), **info, "sequences": part["tokens"].shape[0]})
    data = concat_data(parts)
    n = data["tokens"].shape[0]
    if n < 4:
        raise SpeccError(f"only {n} training sequences; raise --num-prompts")
    in_set = torch.cat([torch.arange(p["tokens"].shape[0]) for p in parts])
    return data, infos, torch.arange(n)[in_set % 10 == 9], torch.arange(n)[in_set % 10 != 9]


def _optimise(head, model, data: dict, train: torch.Tensor, held: torch.Tensor, to_draft, cfg: TrainConfig,
              output: Path, progress: bool) -> tuple[int, list[float], list[float], float]:
    """Train the head's own parameters up to cfg.steps, resuming output's checkpoint and writing new ones; returns
    the step it resumed from, the held-out acceptance before, the losses and the training seconds."""
    params = [p for p in head.parameters() if p.requires_grad and p.data_ptr() not in
              {q.data_ptr() for q in model.parameters()}]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    output.mkdir(parents=True, exist_ok=True)
    ckpt = output / "checkpoint.safetensors"
    start = resume(ckpt, head, opt)
    def lr_scale(s: int) -> float:  # warm-up then cosine; s counts from the resumed step
        s += start
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    gen = torch.Generator().manual_seed(cfg.seed + start)
    before = acceptance(head.eval(), data, held, cfg.eval_depth)
    head.train()
    losses, estimate = [], before
    t1 = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=f"train {cfg.kind}", unit="step", disable=not progress,
               initial=start, total=cfg.steps)
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
            save_checkpoint(ckpt, head, opt, step + 1, cfg.kind)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        held_out_accept=",".join(f"{a:.2f}" for a in estimate[:4]))
    head.eval()
    return start, before, losses, time.perf_counter() - t1


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
    data, infos, held, train = _training_data(model, tokenizer, model_name, data_cfgs, cache, layers)
    data_seconds = time.perf_counter() - t0
    n = data["tokens"].shape[0]
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
    if cfg.lr is None:
        cfg = replace(cfg, lr=default_lr(model.config.hidden_size))
    start, before, losses, train_seconds = _optimise(head, model, data, train, held, to_draft, cfg, output, progress)
    head.eval()
    after = acceptance(head, data, held, cfg.eval_depth)
    in_rounds, n_rounds = round_acceptance(head, data, held, ROUND_K)
    coverage = None
    if to_draft is not None:
        am = data["top_idx"][held][..., 0].long()[data["valid"][held]]
        coverage = (to_draft[am] >= 0).float().mean().item()
    card = {  # the head's card: how it was trained and what it reaches on the held-out sequences
        "kind": cfg.kind, "target": model_name, "train": asdict(cfg),
        "data": {**(infos[0] if len(infos) == 1 else {"sets": infos}), "reused": all(i["reused"] for i in infos),
                 "sequences": n, "train_sequences": len(train), "held_out_sequences": len(held),
                 "tokens": int(data["valid"].sum()), "answer_tokens": int(data["answer"].sum()),
                 "prompts": "stdlib function openings (modules outside the benchmark set) and chat instructions "
                            "(templated; sets with chat 'self': user messages the target wrote itself)",
                 "seconds": round(data_seconds, 1)},
        "draft_vocab_from": None if resumed_vocab is None else str(output / resumed_vocab[1]),
        "steps": cfg.steps, "resumed_from_step": start, "train_seconds": round(train_seconds, 1),
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
