"""`onnxruntime`: ONNX from the exported program, run by ONNX Runtime; the portable CPU default."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.export import ExportedProgram

from .base import LowerOptions

FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"


def _cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def availability(self) -> tuple[bool, str]:
        try:
            import onnx
            import onnxruntime
        except ImportError as exc:
            return False, f"{exc.name} is not installed (pip install onnx onnxruntime onnxscript)"
        return True, f"onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}"

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        import onnx
        import onnxruntime

        path = out_dir / FILE
        with warnings.catch_warnings(), _quiet_exporter():
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(
                program, (), dynamo=True, input_names=input_names, output_names=output_names,
                optimize=True, verbose=False,
            )
        onnx_program.save(str(path), external_data=True)
        onnx.checker.check_model(str(path))
        files = sorted(p.name for p in out_dir.iterdir())
        entry = FILE
        if options.quantize == "int8":
            entry = INT8_FILE
            quantize_int8(path, out_dir / INT8_FILE)
            for name in files:
                (out_dir / name).unlink()
            files = sorted(p.name for p in out_dir.iterdir())
        versions = {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
        return {"entry": entry, "files": files, "versions": versions, "opset": _opset(out_dir / entry)}

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = _cpu_threads()
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        session = ort.InferenceSession(str(graph_dir / entry["entry"]), so, providers=["CPUExecutionProvider"])
        return OrtRunner(session, [i["name"] for i in entry["inputs"]], list(entry["outputs"]))


def quantize_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 weight quantisation of MatMul/Gemm weights (activations quantised at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                     op_types_to_quantize=["MatMul", "Gemm"], use_external_data_format=True)


def _opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


class _quiet_exporter:
    """The dynamo exporter prints progress lines to stdout; keep specc's own progress bars clean."""

    def __enter__(self):
        import contextlib
        import io

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)


class OrtRunner:
    def __init__(self, session, input_names: list[str], output_names: list[str]):
        self.session, self.input_names, self.output_names = session, input_names, output_names

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        feeds = {name: np.ascontiguousarray(t.numpy()) for name, t in zip(self.input_names, inputs)}
        return [torch.from_numpy(o) for o in self.session.run(self.output_names, feeds)]


BACKEND = OnnxRuntimeBackend()
