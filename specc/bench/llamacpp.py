"""llama.cpp baselines for `specc bench --compare llamacpp` (the `llamacpp` extra: the prebuilt
llama-cpp-py-sync wheel, driven through llamacpp_sync.py; or llama-cpp-python, the `llamacpp-native`
extra, which builds the llama.cpp it vendors for this CPU and is used when both are installed).

What a CPU user would run instead of specc, on the same prompt token ids, greedy, batch 1, the
same max_new_tokens, the bundle's EOS ids and the same thread count:

- `llama.cpp target-only`: `Llama.generate` on the target GGUF; the reference every llama.cpp
  output is compared with (llama.cpp's own speculation is judged against llama.cpp, specc's
  against specc's target-only);
- `llama.cpp speculative [DRAFT] k=K`: the same target with a draft GGUF of the same family,
  through llama-cpp-python's `draft_model` hook (SyncLlama has the same one): each round the draft
  model greedily drafts K tokens, the target evaluates them in one batch and keeps the longest
  matching prefix plus its own next token. `default` is llama.cpp's own default draft length (16,
  `--draft-max`);
- without a draft GGUF: `llama.cpp prompt lookup k=K` (`LlamaPromptLookupDecoding`, or
  llamacpp_sync's `PromptLookup`, which drafts the same tokens).

Timing is wall time of the whole `generate` loop per prompt (prefill included, as for specc).
"""
from __future__ import annotations

import ctypes
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpeccError
from ..hardware import usable_cores
from ..runtime.stats import RowStats
from .llamacpp_sync import binding

LLAMACPP_TARGET_ONLY = "llama.cpp target-only"
LLAMACPP_DEFAULT_DRAFT = 16  # llama.cpp common_params.speculative.n_max (--draft-max)


def open_llama(gguf: str | Path, threads: int | None, n_ctx: int = 2048, logits_all: bool = False):
    """A llama.cpp model on `gguf` (llama-cpp-python's `Llama`), CPU, `threads` threads for decode and batches.

    llama.cpp's OpenMP threads wait as its users get them: OMP_WAIT_POLICY as set when the process
    started (libgomp reads it once, when torch loads it), by default spinning a while between
    operators like specc's own ONNX Runtime pool. Passive waits (OMP_WAIT_POLICY=passive) slow
    llama.cpp down markedly, so a fair comparison leaves the policy at its default.

    Without llama-cpp-python, a llamacpp_sync.SyncLlama (llama-cpp-py-sync) with the same methods. Either has
    `specc_binding` (which one) and `specc_system_info` (the CPU features llama.cpp's kernels were built for)."""
    api = binding()
    if not Path(gguf).is_file():
        raise SpeccError(f"GGUF file {gguf} does not exist")
    threads = threads or usable_cores()
    if api == "llama-cpp-py-sync":
        from .llamacpp_sync import SyncLlama, system_info

        llm = SyncLlama(gguf, n_ctx, threads, logits_all=logits_all)
        llm.specc_binding, llm.specc_system_info = api, system_info()
        return llm
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    default, overrides = lib.llama_model_default_params, None
    own_choice = os.environ.get("SPECC_LLAMACPP_EXTRA_BUFFERS", "0") == "1"
    if not own_choice:
        overrides = _repack_overrides(lib, gguf)

        def params():
            p = default()
            p.use_extra_bufts = False
            p.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p) if overrides is not None else None
            return p

        lib.llama_model_default_params = params  # Llama() takes its model parameters from this function
    try:
        llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                    n_gpu_layers=0, verbose=False, seed=0)
    finally:
        lib.llama_model_default_params = default
    llm._specc_buft_overrides = overrides  # llama.cpp reads the patterns while loading; keep them alive with the model
    llm.specc_repacked = "llama.cpp's choice" if own_choice else (len(overrides) - 1 if overrides is not None else 0)
    llm.specc_binding, llm.specc_system_info = api, lib.llama_print_system_info().decode().strip()
    return llm


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# GGUF types whose weights llama.cpp's CPU_REPACK buffer re-lays out for its interleaved AVX2/AVX-512 kernels
# (q4_0_8x8, q4_K_8x8); a tensor of a type it cannot repack must not be placed there (llama.cpp would crash)
REPACK_TYPES = ("Q4_0", "Q4_K")


def _repack_overrides(lib, gguf: str | Path):
    """llama.cpp's weight repacking without its AMX buffer type, as a NULL-terminated override array (or None).

    llama.cpp loads weights into its "extra" CPU buffer types by default: AMX tiles first where the CPU
    reports AMX, then CPU_REPACK. A virtual machine can report AMX without granting tile state, and
    llama.cpp's AMX matmul then segfaults on the first decode. So extra buffer types are turned off and
    the tensors CPU_REPACK handles are placed there explicitly: repacking speeds decoding up and leaves
    greedy output unchanged. SPECC_LLAMACPP_EXTRA_BUFFERS=1 keeps llama.cpp's own choice (for machines
    where AMX works)."""
    from gguf import GGUFReader

    base = Path(lib.__file__).parent / "lib"
    try:
        ggml = ctypes.CDLL(str(next(base.glob("libggml.so*"))))
    except (StopIteration, OSError):
        return None
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    address = (ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(cpu), b"ggml_backend_dev_get_extra_bufts")
               if cpu else None)
    if not address:
        return None
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(cpu)
    bufts, i = {}, 0
    while extra and extra[i]:
        bufts[ggml.ggml_backend_buft_name(extra[i]).decode()] = extra[i]
        i += 1
    if "CPU_REPACK" not in bufts:
        return None
    names = [t.name for t in GGUFReader(str(gguf)).tensors
             if t.tensor_type.name in REPACK_TYPES and len(t.shape) == 2 and int(t.shape[1]) % 8 == 0
             and t.name != "token_embd.weight"]  # the embedding is also read row by row (get_rows), not repackable
    overrides = (_BuftOverride * (len(names) + 1))()
    for entry, name in zip(overrides, names):
        entry.pattern = ("^" + re.escape(name) + "$").encode()
        entry.buft = bufts["CPU_REPACK"]
    return overrides


class GreedyDraftModel:
    """A draft_model hook: a second GGUF drafting `k` tokens greedily after the context it is given."""

    def __init__(self, llm, k: int):
        self.llm, self.k = llm, k
        self.rounds: list[int] = []  # tokens drafted per call

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        out = []
        for token in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == self.k:
                break
        self.rounds.append(len(out))
        return np.array(out, dtype=np.intc)


@dataclass
class LlamaSystem:
    name: str
    llm: object  # llama_cpp.Llama or llamacpp_sync.SyncLlama
    eos_ids: list[int]
    draft: object = None  # a draft_model hook, or None
    settings: dict = field(default_factory=dict)
    family: str = "llamacpp"
    reference: str = LLAMACPP_TARGET_ONLY  # equality is reported against llama.cpp's own target-only

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        tokens, per_prompt, seconds = [], [], 0.0
        for i, ids in enumerate(prompts):
            out, reason, took = self.generate(ids, max_new_tokens)
            tokens.append(out)
            seconds += took
            per_prompt.append({"prompt": i, "new_tokens": len(out), "finish_reason": reason, "seconds": took,
                               "tokens_per_second": len(out) / took if took else None})
        n = sum(len(t) for t in tokens)
        summary = {"requests": len(prompts), "new_tokens": n, "seconds": seconds,
                   "tokens_per_second": n / seconds if seconds else None, "prefill_seconds": None,
                   "draft_seconds": None, "target_seconds": None, "host_seconds": None, **RowStats().to_dict()}
        return {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], str, float]:
        self.llm.draft_model = self.draft
        self.llm.reset()
        out, reason = [], "length"
        start = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if token in self.eos_ids:
                reason = "stop"
                break
            out.append(int(token))
            if len(out) >= max_new_tokens:
                break
        return out, reason, time.perf_counter() - start


def llamacpp_systems(target_gguf: str | Path, draft_gguf: str | Path | None, k_values: list[int], eos_ids: list[int],
                     threads: int | None, n_ctx: int) -> list[LlamaSystem]:
    """llama.cpp target-only, then speculative with the draft GGUF (llama.cpp's default draft length and each k),
    or prompt lookup at each k when there is no draft GGUF."""
    common = {"gguf": str(target_gguf), "threads": threads or usable_cores(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}
    target_only = open_llama(target_gguf, threads, n_ctx)
    common.update(api=target_only.specc_binding, llamacpp_cpu_features=target_only.specc_system_info,
                  repacked_tensors=target_only.specc_repacked)
    if target_only.specc_binding == "llama-cpp-py-sync":
        from .llamacpp_sync import PromptLookup as LlamaPromptLookupDecoding
    else:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    systems = [LlamaSystem(LLAMACPP_TARGET_ONLY, target_only, eos_ids, settings=common)]
    # llama-cpp-python's speculative verify reads the logits of every drafted position (logits_all), which slows
    # target-only decoding (the LM head runs over every prompt token), so target-only has its own Llama without it
    llm = open_llama(target_gguf, threads, n_ctx, logits_all=True)
    if draft_gguf is not None:
        draft_llm = open_llama(draft_gguf, threads, n_ctx)
        label = Path(draft_gguf).name
        for k, tag in [(LLAMACPP_DEFAULT_DRAFT, "default")] + [(k, f"k={k}") for k in k_values]:
            systems.append(LlamaSystem(f"llama.cpp speculative [{label}] {tag}", llm, eos_ids, GreedyDraftModel(draft_llm, k),
                                       {**common, "draft_gguf": str(draft_gguf), "k": k}))
    else:
        for k in k_values:
            systems.append(LlamaSystem(f"llama.cpp prompt lookup k={k}", llm, eos_ids,
                                       LlamaPromptLookupDecoding(num_pred_tokens=k), {**common, "k": k}))
    return systems


def model_gguf(source: str) -> Path | None:
    """The GGUF a bundle's model came from (a .gguf path or a pulled catalog model)."""
    from ..models.load import gguf_source

    return gguf_source(source)


def goal_lines(results: dict) -> list[str]:
    """Same-run ratios a user choosing between the two asks for: specc speculative vs llama.cpp
    target-only and speculative, and vs specc's own (quantised) target-only."""
    systems = results["systems"]

    def best(pred) -> tuple[str, float] | None:
        named = [(n, r["tokens_per_second"]) for n, r in systems.items() if pred(r) and r["tokens_per_second"]]
        return max(named, key=lambda x: x[1]) if named else None

    spec = best(lambda r: r["family"] == "specc" and r["speculative"])
    base = {"specc target-only": best(lambda r: r["family"] == "specc" and not r["speculative"]),
            "llama.cpp target-only": best(lambda r: r["family"] == "llamacpp" and not r["speculative"]),
            "best llama.cpp speculative": best(lambda r: r["family"] == "llamacpp" and r["speculative"])}
    if spec is None:
        return []
    lines = [f"best specc speculative: {spec[0]} {spec[1]:.2f} tok/s"]
    for label, b in base.items():
        if b is not None:
            lines.append(f"  {spec[1] / b[1]:.2f}x {label} ({b[0]}, {b[1]:.2f} tok/s)")
    return lines


def systems_for_bench(models: list, k_values: list[int], opts: dict, prompts: list[list[int]],
                      max_new_tokens: int) -> list[LlamaSystem]:
    """The llama.cpp systems for `run_bench`: GGUFs from opts or from the bundles' recorded model sources."""
    manifest = models[0].bundle.manifest
    target = opts.get("target_gguf") or model_gguf(manifest.models["target"])
    if target is None:
        raise SpeccError(f"--compare llamacpp needs the target as GGUF: {manifest.models['target']!r} is not a .gguf file "
                         "or a pulled catalog model; pass --llamacpp-target FILE.gguf")
    draft = opts.get("draft_gguf")
    if draft is None:
        drafts = [m.bundle.manifest.models.get("draft") for m in models if m.bundle.manifest.models.get("draft")]
        draft = next((g for g in map(model_gguf, drafts) if g is not None), None)
    n_ctx = max(len(p) for p in prompts) + max_new_tokens + LLAMACPP_DEFAULT_DRAFT + 64
    opts["resolved"] = {"target_gguf": str(target), "draft_gguf": str(draft) if draft else None}
    return llamacpp_systems(target, draft, k_values, sorted(models[0].eos_ids), opts.get("threads"), n_ctx)


def gguf_weight_bytes(gguf: str | Path) -> int:
    """Bytes of the GGUF's 2-D tensors except the token embedding (a decode step reads only its rows), plus
    the embedding when no separate output matrix exists (a tied LM head reads all of it)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    total = sum(int(t.n_bytes) for n, t in tensors.items() if len(t.shape) == 2 and n != "token_embd.weight")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        total += int(tensors["token_embd.weight"].n_bytes)
    return total


def annotate(results: dict, models: list, opts: dict) -> None:
    """Add the goal ratios and the bandwidth lines (weights read per target pass x passes/s vs a copy benchmark)."""
    from .bandwidth import copy_bandwidth, specc_weight_bytes

    results["llamacpp"] = opts.get("resolved", {})
    results["goal"] = goal_lines(results)
    gbps = copy_bandwidth(opts.get("threads"))
    weights = {str(m.bundle.path): specc_weight_bytes(m.bundle) for m in models}  # per bundle: targets may differ
    if results["llamacpp"].get("target_gguf"):
        weights["llamacpp"] = gguf_weight_bytes(results["llamacpp"]["target_gguf"])
    lines = [f"memory bandwidth (copy benchmark, read + write): {gbps:.1f} GB/s"]
    for name, r in results["systems"].items():
        per_pass = weights.get(r["settings"].get("bundle") if r["family"] == "specc" else r["family"])
        tokens_per_pass = r.get("tokens_per_target_pass") or (1.0 if not r["speculative"] else None)
        if per_pass is None or not r["tokens_per_second"] or tokens_per_pass is None:
            continue
        passes = r["tokens_per_second"] / tokens_per_pass
        r["weight_bytes_per_pass"], r["weight_gb_per_second"] = per_pass, per_pass * passes / 1e9
        lines.append(f"  {name}: {per_pass / 1e6:.0f} MB/pass x {passes:.2f} passes/s = {r['weight_gb_per_second']:.2f} GB/s "
                     f"({100 * r['weight_gb_per_second'] / gbps:.0f}% of the copy bandwidth)")
        if r["family"] == "specc" and not r["speculative"] and r.get("target_seconds"):
            # decoding alone: every token after a prompt's first is one 1-token pass, timed without the prefill
            steps = (r["new_tokens"] - r["requests"]) / r["target_seconds"]
            r["decode_weight_gb_per_second"] = per_pass * steps / 1e9
            lines.append(f"    decoding alone: {steps:.2f} passes/s = {r['decode_weight_gb_per_second']:.2f} GB/s "
                         f"({100 * r['decode_weight_gb_per_second'] / gbps:.0f}% of the copy bandwidth)")
    results["bandwidth"] = {"copy_gb_per_second": gbps, "weight_bytes_per_pass": weights}
    results["bandwidth_lines"] = lines + compute_lines(results, models, opts.get("threads"))


def compute_lines(results: dict, models: list, threads: int | None) -> list[str]:
    """Each specc system's multiply-adds per second in its target passes (rows verified x the linear layers'
    MACs per row / target seconds) against the integer dot-product peak of specc's kernels here."""
    from .. import kernels
    from .bandwidth import linear_macs_per_row

    if not kernels.available():
        return []
    isa, threads = kernels.active_isa(), threads or usable_cores()
    peak = kernels.dot_peak(isa, threads)
    macs = {str(m.bundle.path): linear_macs_per_row(m.bundle) for m in models}
    lines = [f"integer dot-product peak ({isa}, {threads} threads): {peak:.0f} GMAC/s"]
    for name, r in results["systems"].items():
        per_row = macs.get(r["settings"].get("bundle")) if r["family"] == "specc" else None
        if not per_row or not r.get("target_seconds"):
            continue
        # a speculative round verifies its drafts and one more row; target-only, every token after the first (prefill)
        rows = r["rounds"] + r["drafted"] if r["speculative"] else r["new_tokens"] - r["requests"]
        r["target_gmac_per_second"] = per_row * rows / r["target_seconds"] / 1e9
        lines.append(f"  {name}: {per_row / 1e9:.2f} GMAC/row x {rows / r['target_seconds']:.1f} rows/s in target passes = "
                     f"{r['target_gmac_per_second']:.0f} GMAC/s ({100 * r['target_gmac_per_second'] / peak:.0f}% of the peak)")
    results["compute"] = {"isa": isa, "threads": threads, "dot_peak_gmac_per_second": peak}
    return lines
