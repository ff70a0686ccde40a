"""Self-distillation data for draft heads, cached to disk in safetensors: the target's features at every
position of every sequence and its own next-token top-K there (the labels). The passes that answer a
prompt record them as they go; a separate teacher pass (one forward pass per sequence) covers text
windows and answers journaled without them.

Sequences come from one of two sources:
- answers: the target answers offline prompts greedily (function openings from every Python
  standard-library module that the benchmark prompts do not use, and chat instructions from a
  grid of ~150 topics x 32 templates or, in sets with `chat="self"`, user messages the target
  writes itself (sampled) about those topics: self-instruct, for chat less uniform than a grid).
  Closest to what the head sees at run time; costs one target step per generated token.
- text: windows of the source of a fixed list of modules (TRAIN_MODULES), teacher-forced. One batched pass per window: the
  cheap choice on a shared CPU.
A set cached for one kind's features (EAGLE-1/2's last layer, EAGLE-3's three) gives its answers to
the same set for the other: only the teacher pass runs again.
Positions where the sequence continues as the target's greedy choice (`answer`) are where
held-out acceptance can be measured.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import json
import random
import sysconfig
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..bench.prompts import CHAT, STDLIB_MODULES, function_openings

TRAIN_MODULES = ("argparse", "collections", "dataclasses", "datetime", "decimal", "email.message", "enum",
                 "functools", "gettext", "glob", "gzip", "http.cookies", "imaplib", "inspect", "locale", "logging",
                 "mailbox", "netrc", "operator", "optparse", "pprint", "queue", "random", "re", "sched", "selectors",
                 "shutil", "smtplib", "socketserver", "tarfile", "tempfile", "threading", "tokenize", "traceback",
                 "typing", "unittest.case", "urllib.parse", "uuid", "wave", "zipfile")

TOPICS = (
    # nature and science
    "the moon", "volcanoes", "photosynthesis", "black holes", "rainbows", "glaciers", "earthquakes", "dinosaurs",
    "honey bees", "penguins", "coral reefs", "the immune system", "DNA", "tides", "lightning", "the solar system",
    "gravity", "magnets", "bacteria", "rain forests", "deserts", "migrating birds", "octopuses", "mushrooms",
    "the human heart", "the brain", "sleep", "vaccines", "nutrition", "climate change", "wind power", "nuclear energy",
    "solar panels", "electric cars", "batteries", "the speed of light", "atoms", "chemical reactions", "fossils",
    # history and culture
    "the Roman empire", "the printing press", "the French revolution", "ancient Egypt", "the Silk Road",
    "the Renaissance", "the industrial revolution", "the moon landing", "the Olympic games", "jazz music",
    "classical music", "impressionist painting", "Shakespeare's plays", "Greek mythology", "the Great Wall of China",
    "the invention of the telephone", "the history of money", "medieval castles", "the Vikings", "world war one",
    # everyday life
    "coffee", "bread baking", "gardening", "origami", "kites", "recycling", "time management", "public speaking",
    "saving money", "learning a language", "job interviews", "moving to a new city", "first aid", "camping",
    "cooking rice", "houseplants", "running a marathon", "meditation", "board games", "photography", "knitting",
    "budget travel", "writing a resume", "making friends as an adult", "caring for a dog", "cycling to work",
    # computing
    "sorting algorithms", "git branches", "unit tests", "SQL joins", "linked lists", "regular expressions",
    "HTTP requests", "password security", "the internet", "recursion in programming", "hash functions",
    "binary numbers", "operating systems", "compilers", "cloud computing", "machine learning", "neural networks",
    "databases", "REST APIs", "Python decorators", "Python generators", "JavaScript promises", "Docker containers",
    "code reviews", "version control", "big O notation", "encryption", "computer viruses", "open source software",
    "floating point numbers", "garbage collection", "multithreading", "caching", "spreadsheets", "the stock market",
    # ideas
    "democracy", "the scientific method", "logical fallacies", "probability", "prime numbers", "infinity",
    "fractions", "statistics", "supply and demand", "inflation", "ethics of AI", "friendship", "happiness",
)
TEMPLATES = (
    "Explain {} in simple terms.", "Write a short paragraph about {}.", "Give me three facts about {}.",
    "What are common misconceptions about {}?", "Write a haiku about {}.", "How would you teach {} to a child?",
    "List the pros and cons of {}.", "Write a short story that involves {}.",
    "What questions do beginners ask about {}?", "Summarize the history of {}.",
    "Describe {} to someone from the year 1800.", "Write a limerick about {}.",
    "What is the most surprising thing about {}?", "Give me a one-sentence definition of {}.",
    "Why does {} matter?", "How does {} work?", "Write a short poem about {}.", "Tell me a fun fact about {}.",
    "Compare {} with something from everyday life.", "What should I read to learn about {}?",
    "Write a tweet about {}.", "Explain {} like I am a university student.", "What are five key terms about {}?",
    "Write a dialogue between two friends about {}.", "Give me a quiz question about {} with its answer.",
    "What are the biggest open problems around {}?", "Write a product description inspired by {}.",
    "Outline a ten-minute talk on {}.", "What would change if {} did not exist?",
    "Give me three tips related to {}.", "Write an encouraging note to someone studying {}.",
    "Explain {} in exactly three sentences.",
)
ASKS = (  # kinds of user message the target is asked to write (chat="self")
    "a question", "a how-to question", "a request for advice", "a short writing task", "a request to explain something",
    "a question comparing two things", "a factual question", "a request for a list", "a request to summarize something",
    "a question a beginner would ask", "a request to rewrite or translate a sentence", "a puzzle or a riddle",
)
ASK = ("Write {} that a user might send to an AI assistant, about {} or something it brings to mind. "
       "Reply with that message only.")
QUESTION_TOKENS = 48  # most tokens of a self-written user message
CHATS = ("grid", "self")
PROMPTS_VERSION = 4  # part of the data cache key: bump when the prompt lists change (4: ipaddress, a benchmark module, out)
# Standard-library folders never used as training code (GUI, tests, bundled third-party code).
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
             "dist-packages", "__pycache__", "pydoc_data", "venv"}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DataConfig:
    n_code: int = 96
    n_chat: int = 96
    new_tokens: int = 128
    max_prompt_tokens: int = 192
    top_k: int = 32
    batch: int = 64  # prompts answered at once (decoding reads the weights once a step for all of them)
    seed: int = 0
    source: str = "answers"  # or "text"
    seq_len: int = 256  # text: tokens per window
    dtype: str = "float32"  # the target's passes: float32 or bfloat16 (several times faster on CPUs with AMX)
    code_from: int = 0  # the first code prompt (text: window) used; the ones before belong to earlier sets
    chat_from: int = 0  # the first chat prompt used
    chat: str = "grid"  # chat prompts: "grid" (topic x template) or "self" (user messages the target writes)

    def key(self, model: str) -> str:
        fields = {"model": model, "prompts_version": PROMPTS_VERSION, **asdict(self)}
        # keys of sets cached before these fields existed stay valid
        for name, old in (("dtype", "float32"), ("code_from", 0), ("chat_from", 0), ("chat", "grid")):
            if fields[name] == old:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _stdlib_sources() -> list[Path]:
    """The standard library's Python files, minus the benchmark's modules (specc.bench.prompts) and SKIP_DIRS."""
    root = Path(sysconfig.get_paths()["stdlib"])
    bench = {root / (name.replace(".", "/") + ".py") for name in STDLIB_MODULES}
    bench |= {root / name.replace(".", "/") / "__init__.py" for name in STDLIB_MODULES}
    return [p for p in sorted(root.rglob("*.py"))
            if p not in bench and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]


def training_prompts(cfg: DataConfig) -> list[tuple[str, bool]]:
    """(text, chat) pairs: function openings from the whole standard library except the benchmark's
    modules, and chat instructions from a topic x template grid (none equal to a benchmark prompt)."""
    rng = random.Random(cfg.seed)
    code = []
    for path in _stdlib_sources():
        try:
            code += function_openings(path.read_text(encoding="utf-8"), decorators=False, dunders=True)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
    rng.shuffle(code)
    chat = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    chat = [p for p in chat if p not in CHAT]
    rng.shuffle(chat)
    return ([(p, False) for p in code[cfg.code_from:cfg.code_from + cfg.n_code]]
            + [(p, True) for p in chat[cfg.chat_from:cfg.chat_from + cfg.n_chat]])


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def _left_padded(group: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts padded on the left (generate continues them on the right) and its attention mask."""
    width = max(map(len, group))
    return (torch.tensor([[pad] * (width - len(p)) + p for p in group]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group]))


@contextmanager
def _contiguous_lm_head(model):
    """While generating: the prompt pass hands the LM head its last positions as a strided view, which torch
    multiplies as a batched matmul over a copy of the weight per row (7.5 GB at 16 rows of a 1.5B target in
    bfloat16); a contiguous input avoids it."""
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        hook.remove()


def question_seeds(cfg: DataConfig) -> list[tuple[str, str]]:
    """(instruction, topic) for each of the set's self-written chat prompts: kinds of message x topics,
    shuffled, from cfg.chat_from on (wrapping around: the messages are sampled, so a seed used twice
    still gives another one)."""
    seeds = [(ASK.format(a, t), t) for t in TOPICS for a in ASKS]
    random.Random(cfg.seed + 1).shuffle(seeds)
    return [seeds[(cfg.chat_from + i) % len(seeds)] for i in range(cfg.n_chat)]


# Replies in which the target answers the instruction as an assistant instead of writing a user's message
# ("Sure, please provide the sentence.", "I'm sorry, but I can't ..."): 38 of 384 of Qwen2.5-Coder-1.5B's.
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
    seeds, pad = question_seeds(cfg), _pad_id(tokenizer)
    torch.manual_seed(cfg.seed + cfg.chat_from)
    found: list[str | None] = [None] * len(seeds)
    todo = list(range(len(seeds)))
    with _contiguous_lm_head(model):
        for attempt in range(1 + RESAMPLES):
            for lo in tqdm(range(0, len(todo), cfg.batch), desc=desc if not attempt else f"{desc}, again",
                           unit="batch"):
                rows = todo[lo:lo + cfg.batch]
                ids, mask = _left_padded([_encode(tokenizer, seeds[i][0], True, cfg.max_prompt_tokens) for i in rows], pad)
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


def text_windows(tokenizer, n: int, seq_len: int, first: int = 0) -> list[list[int]]:
    """Windows first..first+n-1 of seq_len tokens from the training modules' source files, in order."""
    ids: list[int] = []
    for name in TRAIN_MODULES:
        try:
            ids += tokenizer(inspect.getsource(importlib.import_module(name)), add_special_tokens=False)["input_ids"]
        except (ImportError, OSError, TypeError):
            continue
        if len(ids) >= (first + n) * seq_len:
            break
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(first, min(first + n, len(ids) // seq_len))]


def _encode(tokenizer, text: str, chat: bool, limit: int) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids)[-limit:]


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


class _Recorder:
    """Forward hooks that keep, while `model.generate` answers a batch, what the teacher pass would compute
    for it: every position's feature (the final norm's output, or the given layers' outputs concatenated)
    and the target's top-K next-token logits (from the LM head's own output where generate computes it,
    the prompt's other positions through the LM head once more, in row chunks)."""

    LOGIT_ROWS = 512  # rows of the extra LM-head pass at once (a 1.5B target's: ~300 MB of logits)

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

    With `top_k`, the passes that answer also record the data of the teacher pass (`_Recorder`, with its
    `feature_layers`): returned by prompt index as {length, features, top_val, top_idx}, for the first
    `length` tokens of its sequence.

    With a journal, every finished batch is appended to it (and its record saved beside it) and a later call
    with the same prompts starts after the batches it holds (hours of answers from a 1.5B target survive an
    interrupted run; the batches are the same, so the answers are those of an uninterrupted run)."""
    pad = _pad_id(tokenizer)
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
    recorder = _Recorder(model, top_k, feature_layers) if top_k is not None and hasattr(model.model, "norm") else None
    try:
        with _contiguous_lm_head(model):
            for j in tqdm(todo, desc=desc, unit="batch", initial=len(batches) - len(todo), total=len(batches)):
                group = [prompts[i] for i in batches[j]]
                ids, mask = _left_padded(group, pad)
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


def _empty(n: int, width: int, hidden: int, top_k: int) -> dict:
    return {"tokens": torch.zeros(n, width, dtype=torch.long), "valid": torch.zeros(n, width, dtype=torch.bool),
            "answer": torch.zeros(n, width, dtype=torch.bool), "features": torch.zeros(n, width, hidden, dtype=torch.float16),
            "top_val": torch.zeros(n, width, top_k, dtype=torch.float16),
            "top_idx": torch.zeros(n, width, top_k, dtype=torch.int32)}


@torch.no_grad()
def _features(model, seqs: list[tuple[list[int], int]], top_k: int, feature_layers: list[int] | None,
              bar: tqdm) -> dict:
    """The teacher pass over seqs, padded to their own longest (see teacher_pass)."""
    hidden = model.config.hidden_size * (len(feature_layers) if feature_layers else 1)
    data = _empty(len(seqs), max(len(s) for s, _ in seqs), hidden, top_k)
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
    an hour of a 1.5B target's features survives an interrupted run."""
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


def _merge(seqs: list[tuple[list[int], int]], recorded: dict[int, dict], rest: list[int], taught: dict | None,
           top_k: int, hidden: int) -> dict:
    """One data set in the sequences' order: recorded rows (their first `length` tokens) and the teacher
    pass's rows (`taught`, over seqs[rest])."""
    if not recorded:
        return taught
    lengths = [recorded[i]["length"] if i in recorded else len(seqs[i][0]) for i in range(len(seqs))]
    data = _empty(len(seqs), max(lengths), hidden, top_k)
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
        prompts = [_encode(tokenizer, text, chat, cfg.max_prompt_tokens) for text, chat in texts]
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
