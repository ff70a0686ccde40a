"""Load Hugging Face causal LMs from a catalog name, a local directory or a GGUF file."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..digest import sha256_of
from ..errors import ModelError
from . import catalog
from .gguf import convert_gguf
from .cache import cache_dir

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path  # the Hugging Face directory the weights came from
    source: str  # what the recipe named


def resolve_source(source: str) -> Path:
    """The HF directory for `source`, pulling or converting it into the cache first if needed."""
    path = Path(source).expanduser()
    if source in catalog.CATALOG:
        return catalog.pull(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is a directory but has no config.json; expected a Hugging Face model directory")
        return path
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir("models") / f"gguf-{sha256_of(path)[:16]}"
        if (out / "config.json").exists():
            return out
        return convert_gguf(path, out)
    raise ModelError(
        f"model {source!r} not found; give a catalog name ({', '.join(catalog.CATALOG)}), "
        "a Hugging Face model directory, or a .gguf file"
    )


def gguf_source(source: str) -> Path | None:
    """The GGUF file a model source was converted from (a .gguf path, or a pulled catalog model), if any."""
    if source in catalog.CATALOG:
        path = catalog.CATALOG[source].gguf_path
        return path if path.is_file() else None
    path = Path(source).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_model(source: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode on `device`, from anything `resolve_source` accepts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_source(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"could not load model from {path}: {exc}") from None
    return LoadedModel(model.to(device).eval(), tokenizer, path, source)


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise ModelError unless both tokenizers map the same strings to the same ids."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv and target_tok.eos_token_id == draft_tok.eos_token_id:
        return
    diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
    raise ModelError(
        f"tokenizers differ: target {target_name!r} has {len(tv)} tokens, draft {draft_name!r} has {len(dv)} "
        f"(first differences: {diff}; eos {target_tok.eos_token_id} vs {draft_tok.eos_token_id}). "
        "Speculative decoding needs one shared vocabulary; pick a draft from the target's family"
    )
