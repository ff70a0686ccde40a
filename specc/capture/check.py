"""`specc models check PATH|NAME` and `specc models list --families`: which registered family
compiles a model, read from its config.json alone (no weights are loaded)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ..limits import context_cost, kv_bytes_per_token
from .families import BY_MODEL_TYPE, FAMILIES, CheckReport, check_config
from ..errors import ModelError
from ..models import catalog


def read_config(source: str):
    """The transformers config of a catalog name (pulled), an HF model directory or a config.json."""
    from transformers import AutoConfig

    path = Path(source).expanduser()
    if source in catalog.CATALOG:
        path = catalog.get(source).hf_dir
        if not (path / "config.json").exists():
            raise ModelError(f"catalog model {source!r} is not pulled yet; `specc models pull {source}` first")
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf":
        raise ModelError(f"{path} is a GGUF file; check the Hugging Face directory it converts to "
                         "(compile or `specc models pull` converts it into the cache)")
    if not path.is_file():
        raise ModelError(f"model {source!r} not found; give a catalog name ({', '.join(catalog.CATALOG)}), "
                         "a Hugging Face model directory or its config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"could not read {path}: {exc}") from None
    model_type = raw.get("model_type")
    if model_type not in BY_MODEL_TYPE:  # the registry refuses it by its model_type alone
        return SimpleNamespace(**{**raw, "model_type": model_type})
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except Exception as exc:  # transformers validates configs with many exception types
        raise ModelError(f"{path}: not a valid {model_type} config: {exc}") from None


def check_model(source: str) -> CheckReport:
    return check_config(read_config(source))


def describe(source: str, report: CheckReport, config=None) -> str:
    if report.family is None:
        return f"{source}: cannot be compiled: " + "; ".join(report.problems)
    lines = [f"{source}: compiles (model_type {report.model_type} -> family {report.family.name}, {report.family.title})"]
    return "\n".join(lines + [f"  {fact}" for fact in report.facts] + context_lines(config))


def context_lines(config) -> list[str]:
    """The model's context window and what its KV cache costs (float32), from its config."""
    cfg = getattr(config, "text_config", None) or config
    try:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim)
    except (AttributeError, TypeError, ZeroDivisionError):
        return []
    window = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(window, int):
        return [f"  context window not stated (config max_position_embeddings); {context_cost(per_token, 2048)}"]
    return [f"  context window {window} tokens (recipes' limits.max_context model); {context_cost(per_token, window)}"]


# Compiled checks behind the table: the heavy matrix of tests/test_model_families.py (`-m heavy -k matrix`:
# every family with every drafter on every CPU backend; the int8 self-draft is ONNX Runtime only) and the
# default run's compiled tests. Each: speculative greedy == target-only greedy == Hugging Face greedy.
MATRIX = "every drafter x ORT, torch, AOTI"
COMPILED_CHECKS: dict[str, str] = {name: MATRIX for name in (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite", "olmo2", "smollm3", "starcoder2",
    "glm4", "mixtral", "qwen3_moe", "gpt_oss")}
COMPILED_CHECKS["gemma3"] = MATRIX + "; torch tree, window 4"


def families_table() -> str:
    """The supported-models table (markdown), generated from the registry."""
    rows = ["| family | model_type | random weights: eager step graph = HF | compiled bundle = HF (random weights) "
            "| real weights | notes |", "|---|---|---|---|---|---|"]
    for f in FAMILIES.values():
        real = ", ".join(f.real_checkpoints) or "—"
        compiled = COMPILED_CHECKS.get(f.name, "not run")
        rows.append(f"| {f.title} | {', '.join(f.model_types)} | logits and greedy (8 prompts) "
                    f"| {compiled} | {real} | {f.notes} |")
    return "\n".join(rows)
