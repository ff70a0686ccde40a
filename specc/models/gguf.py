"""GGUF files as Hugging Face directories: dequantised once into safetensors, then loaded in seconds."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..errors import ModelError


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors HF directory `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelError(f"could not read GGUF file {gguf}: {exc}") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
