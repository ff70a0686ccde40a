"""scripts/gpu_check.py runs end to end in its CPU dry mode: every step, the report, the JSON.

This is all of the GPU check that can run without a GPU; on a GPU the same steps compile
CUDA bundles and run the gpu-marked tests for real.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_dry_run_on_cpu_writes_the_report(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--backends", "torch",
                           "--models", "tiny", "--out", str(out), "--limit-prompts", "2", "--max-new-tokens", "6",
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "**Dry run on CPU**" in report and "## Failures\n\nnone" in report
    assert "| tensorrt " in report  # the doctor section lists the GPU backends
    assert "`pytest -m gpu tests/test_gpu_backends.py`" in report and "skipped" in report  # no GPU: every GPU test skips
    assert "| tiny  | torch " in report and "tiny-torch [model] chain k=4" in report
    results = json.loads((out / "bench-tiny-torch.json").read_text())
    assert results["systems"]["tiny-torch [model] chain k=4"]["outputs_equal"] == "2/2"


def test_cuda_mode_without_a_gpu_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--device cpu" in proc.stderr
