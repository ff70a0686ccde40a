"""Self-instruct chat prompts (`chat="self"` sets): user messages the target writes itself (sampled) about
the corpus topics, for chat less uniform than a topic x template grid."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from .data_config import DataConfig
from .generation import contiguous_lm_head, left_padded, pad_id
from .prompt_corpora import TOPICS, encode

ASKS = (  # kinds of user message the target is asked to write (chat="self")
    "a question", "a how-to question", "a request for advice", "a short writing task", "a request to explain something",
    "a question comparing two things", "a factual question", "a request for a list", "a request to summarize something",
    "a question a beginner would ask", "a request to rewrite or translate a sentence", "a puzzle or a riddle",
)


ASK = ("Write {} that a user might send to an AI assistant, about {} or something it brings to mind. "
       "Reply with that message only.")


QUESTION_TOKENS = 48  # most tokens of a self-written user message


def question_seeds(cfg: DataConfig) -> list[tuple[str, str]]:
    """(instruction, topic) for each of the set's self-written chat prompts: kinds of message x topics,
    shuffled, from cfg.chat_from on (wrapping around: the messages are sampled, so a seed used twice
    still gives another one)."""
    seeds = [(ASK.format(a, t), t) for t in TOPICS for a in ASKS]
    random.Random(cfg.seed + 1).shuffle(seeds)
    return [seeds[(cfg.chat_from + i) % len(seeds)] for i in range(cfg.n_chat)]


# Replies in which the target answers the instruction as an assistant instead of writing a user's message
# ("Sure, please provide the sentence.", "I'm sorry, but I can't ..."): common enough to filter.
ACKNOWLEDGEMENTS = ("sure", "certainly", "of course", "absolutely")
ASSISTANT_OPENINGS = (*ACKNOWLEDGEMENTS, "i'm sorry", "i am sorry", "as an ai", "i'm unable", "i'm not able")
ASSISTANT_PHRASES = ("as an ai", "like me to", "provide the sentence", "provide the message", "provide the details",
                     "provide the content", "provide the request", "what would you like")
RESAMPLES = 2  # times an unusable reply is sampled again before its templated fallback


def _clean_question(text: str) -> str:
    """The message in a reply: its first line that is not a preamble ("Dear AI,", "Sure, here it is:",
    "Subject: ..."), without quotes, markup or a "Question:" label; "" where that line is the target
    speaking as the assistant (ASSISTANT_OPENINGS, ASSISTANT_PHRASES)."""
    for line in (ln.strip().strip("*` ").strip() for ln in text.splitlines()):
        low = line.lower()
        if not line or line.endswith((":", ",")) or low.startswith(("subject:", "topic:", "title:")):
            continue
        if low.startswith(ACKNOWLEDGEMENTS) and '"' in line:  # Sure! "Hey AI, can you ..."
            line = line[line.find('"'):]
        for label in ("user:", "question:", "message:", "request:", "q:"):
            if line.lower().startswith(label):
                line = line[len(label):].strip()
        line = line.strip("\"'*` ").strip()
        low = line.lower().replace("\u2019", "'")
        return "" if low.startswith(ASSISTANT_OPENINGS) or any(p in low for p in ASSISTANT_PHRASES) else line
    return ""


@torch.no_grad()
def written_questions(model, tokenizer, cfg: DataConfig, path: Path, desc: str = "user messages") -> list[str]:
    """cfg.n_chat user messages the target writes itself (sampled at temperature 1, top-p 0.95, from
    question_seeds), kept in `path` (JSON) so that a rerun answers the same ones. A reply that is not a
    usable message (under 8 or over 400 characters, or the target speaking as the assistant) is sampled
    again up to RESAMPLES times, then becomes "Tell me about {topic}."; files written before are used as
    they are."""
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if isinstance(saved, list) and len(saved) == cfg.n_chat and all(isinstance(q, str) and q for q in saved):
                return saved
        except (json.JSONDecodeError, OSError):
            pass
    seeds, pad = question_seeds(cfg), pad_id(tokenizer)
    torch.manual_seed(cfg.seed + cfg.chat_from)
    found: list[str | None] = [None] * len(seeds)
    todo = list(range(len(seeds)))
    with contiguous_lm_head(model):
        for attempt in range(1 + RESAMPLES):
            for lo in tqdm(range(0, len(todo), cfg.batch), desc=desc if not attempt else f"{desc}, again",
                           unit="batch"):
                rows = todo[lo:lo + cfg.batch]
                ids, mask = left_padded([encode(tokenizer, seeds[i][0], True, cfg.max_prompt_tokens) for i in rows], pad)
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=QUESTION_TOKENS, do_sample=True,
                                     temperature=1.0, top_p=0.95, top_k=0, pad_token_id=pad)
                for i, row in zip(rows, gen[:, ids.shape[1]:]):
                    text = _clean_question(tokenizer.decode(row, skip_special_tokens=True))
                    found[i] = text if 8 <= len(text) <= 400 else None
            todo = [i for i in todo if found[i] is None]
            if not todo:
                break
    out = [q or f"Tell me about {topic}." for q, (_, topic) in zip(found, seeds)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".partial").write_text(json.dumps(out, indent=0))
    path.with_suffix(".partial").rename(path)
    return out
