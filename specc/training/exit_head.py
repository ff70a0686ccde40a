"""`specc train-exit-head`: distil the target's final distribution into an early-exit adapter.

The target runs once over a local text corpus (by default the Python standard library
sources), recording the hidden state after `layer` layers and the top-K of the final
logits. A small residual MLP (ExitAdapter) is then trained on CPU so that the target's own
final norm and LM head, applied after the adapter, match the final distribution
(cross-entropy against the teacher's renormalised top-K). Only the adapter learns.
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..capture.blocks.norms import norm_facts
from ..capture.step_decoder import StepDecoder
from ..errors import SpeccError
from ..heads.exit import ExitAdapter, ExitHead

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".yaml", ".yml", ".c", ".h", ".js", ".ts")


@dataclass
class TrainConfig:
    layer: int
    corpus: Path | None = None
    train_tokens: int = 60_000
    eval_tokens: int = 6_000
    seq_len: int = 256
    rank: int | None = None  # adapter width; default: the hidden size
    steps: int = 300
    batch_tokens: int = 512
    lr: float = 2e-3
    top_k: int = 64
    seed: int = 0


def corpus_files(corpus: Path | None) -> list[Path]:
    root = Path(corpus) if corpus else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise SpeccError(f"corpus {root} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                   and "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise SpeccError(f"corpus {root} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def token_sequences(tokenizer, files: list[Path], n_tokens: int, seq_len: int, skip: int = 0) -> torch.Tensor:
    """[N, seq_len] token ids from the corpus files in order, after skipping `skip` tokens."""
    ids: list[int] = []
    need = skip + n_tokens
    for path in files:
        text = path.read_text(errors="ignore")
        if text.strip():
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    ids = ids[skip:need]
    n = len(ids) // seq_len
    if n == 0:
        raise SpeccError(f"the corpus gives only {len(ids)} tokens after skipping {skip}; need at least {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def teacher_pass(model, seqs: torch.Tensor, layer: int, top_k: int, desc: str):
    """Hidden states after `layer` layers and the final logits' top-K, for every token."""
    hidden, vals, idx = [], [], []
    for row in tqdm(seqs, desc=desc, unit="seq"):
        out = model(row[None], output_hidden_states=True)
        hidden.append(out.hidden_states[layer][0])
        top = torch.topk(out.logits[0].float(), top_k, dim=-1)
        vals.append(top.values)
        idx.append(top.indices)
    return torch.cat(hidden), torch.cat(vals), torch.cat(idx)


def exit_head(model, adapter: ExitAdapter | None) -> ExitHead:
    """The early-exit head over this model's final norm and LM head, as the draft graph computes it."""
    decoder = StepDecoder(model)  # the final norm and logit scaling as captured for this family
    facts = norm_facts(decoder.norm)
    bias = decoder.norm.bias if facts["norm_kind"] == "layer" else None
    return ExitHead(decoder.norm.weight, model.lm_head.weight, facts["norm_eps"], facts["norm_offset"], adapter, bias,
                    decoder.logits_divisor, decoder.final_softcap)


@torch.no_grad()
def agreement(head: ExitHead, model, seqs: torch.Tensor, layer: int) -> dict:
    """Greedy top-1 agreement and expected sampling acceptance sum(min(p, q)) at temperature 1."""
    top1 = accept = n = 0.0
    for row in seqs:
        out = model(row[None], output_hidden_states=True)
        p = torch.softmax(out.logits[0].float(), -1)
        q = torch.softmax(head(out.hidden_states[layer][0]), -1)
        top1 += (p.argmax(-1) == q.argmax(-1)).float().sum().item()
        accept += torch.minimum(p, q).sum(-1).sum().item()
        n += p.shape[0]
    return {"greedy_top1_agreement": top1 / n, "expected_sampling_acceptance": accept / n, "tokens": int(n)}


def train_exit_head(model, tokenizer, cfg: TrainConfig) -> tuple[ExitAdapter, dict]:
    """Train an adapter for exits after cfg.layer layers; returns it and a report (before/after agreement)."""
    n_layers = model.config.num_hidden_layers
    if not 1 <= cfg.layer < n_layers:
        raise SpeccError(f"--layer must be in [1, {n_layers - 1}] for this {n_layers}-layer model, got {cfg.layer}")
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    files = corpus_files(cfg.corpus)
    train = token_sequences(tokenizer, files, cfg.train_tokens, cfg.seq_len)
    evals = token_sequences(tokenizer, files, cfg.eval_tokens, cfg.seq_len, skip=train.numel())
    hidden, top_vals, top_idx = teacher_pass(model, train, cfg.layer, cfg.top_k, "teacher pass")
    hidden_size = model.config.hidden_size
    adapter = ExitAdapter(hidden_size, cfg.rank or hidden_size, exit_head(model, None).eps)
    head = exit_head(model, adapter)
    before = agreement(exit_head(model, None), model, evals, cfg.layer)
    target = torch.softmax(top_vals, -1)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    losses = []
    bar = tqdm(range(cfg.steps), desc="train adapter", unit="step")
    for _ in bar:
        pick = torch.randint(0, hidden.shape[0], (cfg.batch_tokens,))
        logq = torch.log_softmax(head(hidden[pick]), -1)
        loss = -(target[pick] * logq.gather(-1, top_idx[pick])).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    adapter.eval()
    after = agreement(head, model, evals, cfg.layer)
    report = {"layer": cfg.layer, "layers": n_layers, "train_tokens": int(train.numel()), "steps": cfg.steps,
              "final_loss": sum(losses[-20:]) / len(losses[-20:]), "without_adapter": before, "with_adapter": after,
              "corpus": str(cfg.corpus or "python standard library")}
    return adapter, report
