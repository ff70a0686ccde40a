"""Cost curve of a target pass per kernel option: ms per pass of T tokens at a given cache length.

    python scripts/cost_curve.py BUNDLE [--gguf FILE] [--tokens 1 2 4 6 9] [--cache 100] [--repeats 5] [--json out.json]

BUNDLE must hold a float32 onnxruntime target graph (target/model.onnx). Each option re-quantises
that graph in a temporary directory (onnx_passes/quantize_matmul_nbits.py or quantize_int8_gemm.py, as `target.quantize`
does) and times
ONNX Runtime sessions set up like the onnxruntime backend's (all the CPUs this process may use:
restrict them with taskset); options are timed interleaved, the median of --repeats is reported.
The top-1 agreement column compares each option's last-row argmax with float32's over the timed
inputs (random cache, real token ids of a fixed text).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from specc.backends.onnxruntime_backend import quantize_blocks, session_options
from specc.hardware import usable_cores
from specc.onnx_passes import QuantConfig

OPTIONS = {
    "float32": None,
    "int4 b32 acc4": dict(bits=4, block_size=32, accuracy_level=4),
    "int4 b128 acc4": dict(bits=4, block_size=128, accuracy_level=4),
    "int4 b32 acc1": dict(bits=4, block_size=32, accuracy_level=1),
    "int4 b32 acc4 lm_head fp32": dict(bits=4, block_size=32, accuracy_level=4, keep_float=("lm_head",)),
    "int8 b32 acc4": dict(bits=8, block_size=32, accuracy_level=4),
    "int8-gemm": dict(bits=8, kind="int8-gemm"),
}


def session(path: Path):
    """A session with the runtime's own options (pools that spin during runs only: backends/onnxruntime_backend.py)."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])


def feeds(entry: dict, tokens: int, cache: int, rng) -> dict:
    m = entry["model"]
    shape = (m["n_layers"], 1, m["n_kv_heads"], cache, m["head_dim"])
    return {"input_ids": rng.integers(0, m["vocab_size"], (1, tokens)).astype(np.int64),
            "position_ids": (cache + np.arange(tokens))[None].astype(np.int64),
            "cache_len": np.array([cache], np.int64), "logit_index": np.arange(tokens)[None].astype(np.int64),
            "k_cache": rng.normal(size=shape).astype(np.float32), "v_cache": rng.normal(size=shape).astype(np.float32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--gguf", type=Path, help="also the GGUF's own blocks (int4, no second rounding)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 9])
    ap.add_argument("--cache", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--options", nargs="+", help=f"subset of: {', '.join(OPTIONS)}, gguf")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    entry = manifest["graphs"]["target"]
    src = args.bundle / "target" / "model.onnx"
    options = dict(OPTIONS)
    if args.gguf:
        options["gguf blocks acc4"] = dict(bits=4, block_size=32, accuracy_level=4, gguf=args.gguf)
    if args.options:
        options = {k: v for k, v in options.items() if k in args.options or (k.startswith("gguf") and "gguf" in args.options)}
    sessions, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, opt in options.items():
            if opt is None:
                sessions[name], sizes[name] = session(src), None
                continue
            opt = dict(opt)
            gguf = opt.pop("gguf", None)
            config = QuantConfig(**opt)
            if gguf:
                from specc.models.gguf_blocks import read_gguf_blocks

                config.imported = read_gguf_blocks(gguf, config.bits)
            dst = Path(tmp) / name.replace(" ", "_") / "model.nbits.onnx"
            dst.parent.mkdir()
            summary = quantize_blocks(src, dst, config)
            sessions[name], sizes[name] = session(dst), summary
        rng = np.random.default_rng(0)
        inputs = {t: feeds(entry, t, args.cache, rng) for t in args.tokens}
        times = {(n, t): [] for n in sessions for t in args.tokens}
        tops = {n: [] for n in sessions}
        for s in sessions.values():  # warm-up
            s.run(["logits"], inputs[args.tokens[0]])
        for _ in range(args.repeats):
            for t in args.tokens:
                for n, s in sessions.items():
                    start = time.perf_counter()
                    logits = s.run(["logits"], inputs[t])[0]
                    times[(n, t)].append(1000 * (time.perf_counter() - start))
                    tops[n].append(logits[0].argmax(-1))
    ref = tops["float32"] if "float32" in tops else None
    rows = []
    for n in sessions:
        agree = float(np.mean(np.concatenate([a == b for a, b in zip(tops[n], ref)]))) if ref is not None else None
        mb = sizes[n]["weight_bytes"] / 1e6 if sizes[n] else None
        rows.append({"option": n, "ms": {t: statistics.median(times[(n, t)]) for t in args.tokens},
                     "weight_mb": mb, "top1_agreement_with_float32": agree,
                     "layers": sizes[n]["layers"] if sizes[n] else None})
    head = "| option | " + " | ".join(f"T={t} ms" for t in args.tokens) + " | weights MB | top-1 vs fp32 |"
    print(head)
    print("|" + "---|" * (len(args.tokens) + 3))
    for r in rows:
        ms = " | ".join(f"{r['ms'][t]:.1f}" for t in args.tokens)
        mb = f"{r['weight_mb']:.0f}" if r["weight_mb"] else "(fp32 file)"
        agree = f"{r['top1_agreement_with_float32']:.3f}" if r["top1_agreement_with_float32"] is not None else "-"
        print(f"| {r['option']} | {ms} | {mb} | {agree} |")
    if args.json:
        args.json.write_text(json.dumps({"cache": args.cache, "threads": usable_cores(), "repeats": args.repeats,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
