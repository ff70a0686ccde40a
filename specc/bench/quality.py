"""`specc eval`: what quantisation costs in quality, on a fixed text set.

Every text is run teacher-forced (one pass over its tokens) through each system; per system:

- top-1 agreement: how often its most likely next token equals the float32 target's, over all
  positions (the float32 target is the bundle's model source in transformers, float32);
- perplexity of the text's own next tokens.

Systems: the float32 target, the bundle's compiled target (e.g. int4 MatMulNBits), and
optionally llama.cpp running a GGUF of the same model (`--gguf`, needs the `llamacpp` extra).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..errors import SpeccError


def _scores(logits: np.ndarray, ids: list[int]) -> tuple[np.ndarray, float, int]:
    """(argmax per position except the last, summed next-token NLL, positions) for logits [T, V]."""
    logits = logits.astype(np.float64)
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].sum()
    return logits[:-1].argmax(-1), float(nll), len(ids) - 1


def bundle_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of a bundle's compiled target over `ids`, one prefill pass from an empty cache."""
    from ..runtime.kv_cache import KVCache

    cache = KVCache(model.target.dims, 1, model.max_context, model.device)
    cache.ensure(len(ids))
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    logits = model.target.step(x, cache, torch.arange(len(ids), device=model.device)[None])[0]
    return logits[0].float().cpu().numpy()


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def llamacpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def evaluate(model, texts: list[list[int]], gguf: str | Path | None = None, threads: int | None = None) -> dict:
    """Agreement with the float32 target and perplexity, per system; texts are token-id lists."""
    from ..models.load import load_model

    if any(len(t) < 2 for t in texts):
        raise SpeccError("every eval text needs at least 2 tokens")
    too_long = max(len(t) for t in texts)
    if too_long > model.max_context:
        raise SpeccError(f"an eval text has {too_long} tokens, above the bundle's max_context {model.max_context}")
    source = model.bundle.manifest.models["target"]
    hf = load_model(source, "float32").model
    systems = {"float32 target (transformers)": lambda ids: hf_logits(hf, ids),
               f"specc {_label(model)}": lambda ids: bundle_logits(model, ids)}
    if gguf is not None:
        from .llamacpp import open_llama

        llm = open_llama(gguf, threads, n_ctx=max(too_long, 64), logits_all=True)
        systems[f"llama.cpp {Path(gguf).name}"] = lambda ids: llamacpp_logits(llm, ids)
    reference: list[np.ndarray] = []
    out = {}
    for name, fn in systems.items():
        agree = total = 0
        nll = 0.0
        for i, ids in enumerate(texts):
            top, n_nll, n = _scores(fn(ids), ids)
            if not out:
                reference.append(top)
            agree += int((top == reference[i]).sum())
            nll += n_nll
            total += n
        out[name] = {"positions": total, "top1_agreement_with_float32": agree / total, "perplexity": math.exp(nll / total)}
    return out


def text_chunks(model, path: str | Path, chunk_tokens: int) -> list[list[int]]:
    """A text file's token ids (the bundle's tokenizer, no template) cut into pieces of chunk_tokens."""
    if chunk_tokens < 2:
        raise SpeccError(f"--chunk-tokens {chunk_tokens}: needs at least 2")
    ids = model.tokenizer(Path(path).read_text(), add_special_tokens=False)["input_ids"]
    return [ids[i:i + chunk_tokens] for i in range(0, len(ids) - 1, chunk_tokens) if len(ids[i:i + chunk_tokens]) >= 2]


def _label(model) -> str:
    graph = model.bundle.graph("target")
    q = graph.facts.get("weight_quant")
    if q is None:
        return "target (" + (graph.quantize or "float32") + ")"
    if q.get("kind") in ("int8-gemm", "int4-gemm"):
        return f"target {q['kind']}"
    return f"target int{q['bits']} block {q['block_size']} acc {q['accuracy_level']}"


def format_eval(results: dict) -> str:
    from .table import table

    rows = [[name, r["positions"], r["top1_agreement_with_float32"], r["perplexity"]] for name, r in results.items()]
    return table(["system", "positions", "top-1 agreement with float32", "perplexity"], rows, "lrrr")
