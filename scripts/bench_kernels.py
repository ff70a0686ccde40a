"""One linear layer on each CPU kernel specc can use: ms per call for passes of M rows, beside the memory time of
its 4-bit weights and the integer dot-product peak of this CPU.

    python scripts/bench_kernels.py [--n 8960] [--k 1536] [--rows 1 2 4 5 8 16] [--weights cache|memory]
                                    [--repeats 30] [--json out.json]
    python scripts/bench_kernels.py --bundle BUNDLE [--cache 512] [--rows ...] [--json out.json]

Systems: ONNX Runtime's MatMulNBits (int4 blocks of 32, accuracy level 4: target.quantize int4), ONNX Runtime's
integer GEMM as specc's int8-gemm pass emits it, specc's Int4Gemm inside ONNX Runtime (the kernel chosen here:
target.quantize int4-gemm), torch's int4 weight-only kernel and oneDNN's dynamic int8 linear through torch (the
alternatives docs/backends.md weighs), and each of specc's kernels this CPU runs, called directly. Every ONNX Runtime session
is set up as the runtime's (all usable CPUs). --weights cache times one weight over and over (it stays in the
caches, as the kernel table of issue-style comparisons does); --weights memory rotates through copies of the
weight adding up to 128 MB, so every call reads its weights from DRAM, as decoding does.

--bundle times whole passes instead: the bundle's own target and draft graphs (ONNX Runtime, as the runtime opens
them) on passes of M tokens over a cache of --cache positions, so the M=5 / M=1 column is what a 4-token verify
costs against a decode step, and the memory line is the target's weight bytes over the copy bandwidth. It then
times --wall-pairs pairs of a copy benchmark and a 1-token target pass back to back: a shared machine's bandwidth
drifts within a run, and each pair's ratio (the weights' memory time at that copy bandwidth over the pass) says how
close decoding is to the memory wall whatever the drift. With --llama-bench BIN --gguf FILE, llama.cpp's decoding
takes turns with specc's the same way (llama-bench, 32 tokens after --cache tokens of context, its own weight bytes):

    python scripts/bench_kernels.py --bundle BUNDLE --rows 1 5 --llama-bench ~/.cache/specc/llama.cpp/VERSION/bin/llama-bench \
                                    --gguf ~/.cache/specc/gguf/qwen2.5-coder-1.5b-instruct.gguf
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specc import kernels
from specc.kernels import DOMAIN, OP
from specc.backends.onnxruntime_backend import session_options
from specc.bench.bandwidth import copy_bandwidth, onnx_linear_macs_per_row
from specc.block_weights import quantize_rtn
from specc.hardware import cpu, usable_cores
from specc.kernels.pack import pack_int4
from specc.onnx_passes.linear_layers import QuantConfig
from specc.onnx_passes.quantize_int4_gemm import QuantizeInt4Gemm
from specc.onnx_passes.quantize_int8_gemm import QuantizeInt8Gemm
from specc.onnx_passes.quantize_matmul_nbits import QuantizeMatMulNBits

ROTATION_BYTES = 128 << 20


def _linear_graph(w: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'layers.0.mlp.up_proj', 'linear']")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", n])],
                              [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _session(model, custom: bool = False):
    import onnxruntime as ort

    so = session_options(own_kernels=custom)
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x[None]})


def ort_systems(w: np.ndarray) -> dict:
    """name -> a builder of a callable(x [M, K]) for each ONNX Runtime system, on weight w."""
    def nbits():
        model = _linear_graph(w)
        QuantizeMatMulNBits(QuantConfig(4, 32, 4))(model)
        return _session(model)

    def int8_gemm():
        model = _linear_graph(w)
        QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm"))(model)
        return _session(model)

    def int4_gemm():
        model = _linear_graph(w)
        QuantizeInt4Gemm(QuantConfig(4, kind="int4-gemm"))(model)
        return _session(model, True)

    return {"ONNX Runtime MatMulNBits int4, accuracy 4": nbits, "ONNX Runtime int8-gemm (MatMulInteger)": int8_gemm,
            f"specc Int4Gemm in ONNX Runtime ({kernels.active_isa()})": int4_gemm}


def direct_systems(w: np.ndarray, threads: int) -> dict:
    """name -> a builder of a callable(x [M, K]) for each of specc's kernels this CPU runs, called directly; each
    callable has its own copy of the packed weight."""
    packed = pack_int4(quantize_rtn(w, 4, 32, True))

    def build(isa: str):
        own = dataclasses.replace(packed, data=packed.data.copy())
        return lambda x: kernels.gemm(x, own, isa, threads)

    return {f"specc int4 {isa}, direct": (lambda isa=isa: build(isa)) for isa in kernels.supported_isas() if isa != "scalar"}


def torch_systems(w: np.ndarray, threads: int) -> dict:
    """name -> a builder of a callable(x [M, K]) for torch's own CPU kernels on weight w: the int4 weight-only GEMM
    (groups of 32, what torchao's CPU int4 layout calls; bfloat16 activations) and oneDNN's dynamic int8 linear (8-bit
    weights, activations quantised per pass), where this torch has them."""
    import torch

    torch.set_num_threads(threads)
    n, k = w.shape
    wt = torch.from_numpy(w)

    def int4pack():
        groups = wt.reshape(n, k // 32, 32)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale  # torch's form: (q - 8) * scale + zero
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # bfloat16 activations: the kernel's fast path (its float32 path is a plain loop)
        scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(torch.from_numpy(x).to(torch.bfloat16), packed, 32,
                                                                    scales_zeros)

    def onednn_int8():
        torch.backends.quantized.engine = "onednn"
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = wt.clone()
        model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, torch.qint8)
        return lambda x: model(torch.from_numpy(x))

    systems = {}
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and k % 32 == 0:
        systems["torch int4 weight-only, bf16 activations (_weight_int4pack_mm_for_cpu)"] = int4pack
    if "onednn" in torch.backends.quantized.supported_engines:
        systems["torch oneDNN dynamic int8 linear"] = onednn_int8
    return systems


def time_system(builder, copies: int, k: int, rows: list[int], repeats: int) -> dict:
    calls = [builder() for _ in range(copies)]
    rng = np.random.default_rng(0)
    out = {}
    for m in rows:
        x = rng.normal(size=(m, k)).astype(np.float32)
        for c in calls:
            c(x)
        samples = []
        for i in range(repeats * copies):
            start = time.perf_counter()
            calls[i % copies](x)
            samples.append(time.perf_counter() - start)
        out[str(m)] = statistics.median(samples) * 1e3
    return out


def bundle_systems(bundle: Path, cache: int, room: int) -> tuple[dict, dict, int]:
    """name -> a builder of a callable(x [M, K]) running one pass of M <= room tokens through each ONNX Runtime graph
    of the bundle (target, draft) after `cache` cached positions; name -> the graph's linear multiply-adds per row;
    and the target's weight bytes."""
    import onnxruntime as ort

    manifest = json.loads((bundle / "manifest.json").read_text())
    systems, macs, target_bytes = {}, {}, 0
    for role, entry in manifest["graphs"].items():
        if manifest.get("backend") != "onnxruntime" or not entry.get("cache_by_layer"):
            continue
        quant = entry.get("weight_quant") or {}
        kernel = f"{DOMAIN}::{OP} ({kernels.active_isa()})" if quant.get("kind") == "int4-gemm" else "ONNX Runtime"
        label = f"{role} pass ({entry.get('quantize') or 'float32'}, {kernel})"
        if role == "target":
            target_bytes = quant.get("weight_bytes", 0)
        macs[label] = onnx_linear_macs_per_row(bundle / entry["dir"] / entry["entry"])

        def build(entry=entry, role=role, quant=quant):
            so = session_options(own_kernels=quant.get("kind") == "int4-gemm")
            session = ort.InferenceSession(str(bundle / entry["dir"] / entry["entry"]), so,
                                           providers=["CPUExecutionProvider"])
            m = entry["model"]
            rng = np.random.default_rng(0)
            # the graph writes a pass's keys into the cache at their positions: room for them after the cached ones
            slots = cache + room
            # on 64-byte boundaries, as the runtime's caches are (torch allocates them so)
            caches = {i.name: kernels.aligned_empty((1, m["n_kv_heads"], slots, m["head_dim"]))
                      for i in session.get_inputs() if i.name.startswith(("k_cache.", "v_cache."))}
            for c in caches.values():
                c[...] = rng.normal(size=c.shape)

            def run(x: np.ndarray):
                t = x.shape[0]
                feeds = {"input_ids": np.full((1, t), 100, np.int64), "position_ids": (cache + np.arange(t))[None],
                         "cache_len": np.array([cache], np.int64), "logit_index": np.arange(t)[None], **caches}
                return session.run(["logits"], feeds)
            return run

        systems[label] = build
    if not systems:
        raise SystemExit(f"{bundle}: no ONNX Runtime graph with per-layer caches to time")
    return systems, macs, target_bytes


def specc_decode_ms(target_pass, calls: int = 5):
    """A callable timing a 1-token pass of the bundle's target: ms, the median of `calls`."""
    x = np.zeros((1, 1), np.float32)

    def ms() -> float:
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            target_pass(x)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3
    return ms


def llama_decode_ms(binary: Path, gguf: Path, threads: int, depth: int):
    """A callable timing llama.cpp's decoding with llama-bench: ms per token of 32 tokens after `depth` tokens of
    context (its libraries beside the binary, as scripts/build_llamacpp.sh installs them)."""
    libs = os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "32", "-d", str(depth), "-r", "1", "-o", "json"]

    def ms() -> float:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        try:
            return 1e3 / json.loads(done.stdout)[0]["avg_ts"]
        except (ValueError, LookupError, TypeError, ZeroDivisionError):
            raise SystemExit(f"llama-bench printed no decoding speed (-o json): {done.stdout.strip()[-500:]!r}") from None
    return ms


def wall_pairs(decode_ms, weight_bytes: int, pairs: int) -> dict:
    """`pairs` back-to-back measurements of the copy bandwidth and of a decode step (`decode_ms()`); each pair's
    share of the wall is the weights' memory time at that bandwidth over the step's time."""
    out = []
    for _ in range(pairs):
        gbps = copy_bandwidth(repeats=2)
        ms = decode_ms()
        out.append({"copy_gb_per_second": gbps, "pass_ms": ms, "share": weight_bytes / (gbps * 1e9) * 1e3 / ms})
    return summarise_wall(out, weight_bytes)


def summarise_wall(pairs: list[dict], weight_bytes: int) -> dict:
    """The pairs with the median, lowest and highest share of the wall."""
    shares = sorted(p["share"] for p in pairs)
    return {"pairs": pairs, "weight_bytes": weight_bytes, "median_share": statistics.median(shares),
            "min_share": shares[0], "max_share": shares[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8960, help="output size (default: Qwen2.5-1.5B's gate/up projection)")
    ap.add_argument("--k", type=int, default=1536, help="input size")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    ap.add_argument("--weights", choices=("cache", "memory"), default="cache")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--bundle", type=Path, help="time the bundle's target and draft passes instead of one layer")
    ap.add_argument("--cache", type=int, default=512, help="cached positions before each timed pass (--bundle)")
    ap.add_argument("--wall-pairs", type=int, default=15, metavar="N",
                    help="copy-benchmark and 1-token target-pass pairs timed back to back (--bundle; 0: none)")
    ap.add_argument("--llama-bench", type=Path, metavar="BIN", help="llama.cpp's llama-bench: its decoding in the wall pairs too")
    ap.add_argument("--gguf", type=Path, help="the GGUF llama-bench decodes (with --llama-bench)")
    args = ap.parse_args(argv)
    if bool(args.llama_bench) != bool(args.gguf) or (args.llama_bench and not args.bundle):
        ap.error("--llama-bench and --gguf go together, with --bundle")
    for path in filter(None, (args.llama_bench, args.gguf)):
        if not path.is_file():
            ap.error(f"{path}: no such file")
    threads = usable_cores()
    gbps = copy_bandwidth()
    if args.bundle:
        builders, macs_per_row, int4_bytes = bundle_systems(args.bundle, args.cache, max(args.rows))
        copies, title = 1, f"passes of {args.bundle.name} after {args.cache} cached tokens"
    else:
        w = np.random.default_rng(1).normal(size=(args.n, args.k)).astype(np.float32) * 0.02
        int4_bytes = quantize_rtn(w, 4, 32).nbytes()
        copies = 1 if args.weights == "cache" else max(2, -(-ROTATION_BYTES // int4_bytes))
        builders = {**ort_systems(w), **torch_systems(w, threads), **direct_systems(w, threads)}
        macs_per_row = dict.fromkeys(builders, args.n * args.k)
        title = f"one linear layer, N={args.n} K={args.k}, weights in {args.weights}"
    memory_ms = int4_bytes / (gbps * 1e9) * 1e3
    systems = {}
    for name, builder in builders.items():
        print(f"timing {name} ...", file=sys.stderr)
        ms = time_system(builder, copies, args.k, args.rows, args.repeats)
        macs = macs_per_row[name] * max(args.rows)
        systems[name] = {"ms": ms, "gmac_per_second": macs / (ms[str(max(args.rows))] * 1e-3) / 1e9}
    wall = None
    if args.bundle and args.wall_pairs > 0:
        print(f"timing {args.wall_pairs} pairs of a copy and a 1-token target pass ...", file=sys.stderr)
        target = next(b for name, b in builders.items() if name.startswith("target pass"))
        specc_ms = specc_decode_ms(target())
        if args.llama_bench:
            from specc.bench.llamacpp import gguf_weight_bytes

            llama_ms = llama_decode_ms(args.llama_bench, args.gguf, threads, args.cache)
            llama_bytes = gguf_weight_bytes(args.gguf)
            specc_pairs, llama_pairs = [], []
            for _ in range(args.wall_pairs):  # the two take turns, so that drift meets both alike
                specc_pairs += wall_pairs(specc_ms, int4_bytes, 1)["pairs"]
                llama_pairs += wall_pairs(llama_ms, llama_bytes, 1)["pairs"]
            wall = summarise_wall(specc_pairs, int4_bytes)
            wall["llamacpp"] = {**summarise_wall(llama_pairs, llama_bytes), "binary": args.llama_bench.name,
                                "gguf": args.gguf.name}
        else:
            wall = wall_pairs(specc_ms, int4_bytes, args.wall_pairs)
    peaks = {isa: kernels.dot_peak(isa, threads) for isa in kernels.supported_isas() if isa != "scalar"}
    for name, s in systems.items():
        isa = next((i for i in peaks if name.endswith(f"{i}, direct") or f"({i})" in name), None)
        if isa is not None and "gmac_per_second" in s:
            s["share_of_dot_peak"] = s["gmac_per_second"] / peaks[isa]
    result = {"kind": "kernels", "title": title,
              "date": datetime.date.today().isoformat(), "machine": cpu(), "threads": threads,
              "command": "python scripts/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "measured_by": "scripts/bench_kernels.py", "provenance": "measured",
              **({"bundle": args.bundle.name, "cache": args.cache} if args.bundle else
                 {"n": args.n, "k": args.k, "weights": args.weights}),
              "rows": args.rows, "int4_weight_bytes": int4_bytes,
              "copy_gb_per_second": gbps, "memory_ms": memory_ms, "dot_peak_gmac_per_second": peaks,
              "systems": systems, **({"wall": wall} if wall else {})}
    from specc.bench.results import kernel_table

    print(kernel_table({**result, "run": "this run", "systems": [{**s, "name": k} for k, s in systems.items()]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
