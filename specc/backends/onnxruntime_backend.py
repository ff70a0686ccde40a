"""`onnxruntime`: ONNX from the exported program, run by ONNX Runtime; the portable CPU default."""
from __future__ import annotations

import logging
import os
import shutil
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.export import ExportedProgram

from ..errors import BundleError
from ..hardware import usable_cores
from ..onnx_passes import AttendAtCachePositions, QuantConfig, onnxruntime_target_pipeline, run_onnx_passes
from ..onnx_passes.feed_cache_by_layer import FeedCacheByLayer, by_layer, stacked_input
from ..onnx_passes.fold_weight_transposes import FoldWeightTransposes
from .base import LowerOptions, check_engine_matches, require_version
from .onnx_export import export_onnx, fused_op_counts, opset_of

FILE = "model.onnx"
QUANTIZED_FILES = {"int8": "model.int8.onnx", "int4": "model.int4.onnx"}
NBITS_FILE = "model.nbits.onnx"
OPSET = 23  # Attention, RMSNormalization and RotaryEmbedding are single operators from opset 23


def session_options(own_kernels: bool = False):
    """Options of every ONNX Runtime session specc opens: all optimisations, a pool of the process's CPUs
    per session whose threads spin between operators during a run and stop spinning when it returns.

    Draft and target sessions alternate many times per round. Pools that kept spinning after a run
    would steal the cores from the other session; passive pools pay a thread wake-up for every
    operator. `session.force_spinning_stop` keeps the spinning inside runs.
    SPECC_ORT_SPIN=0 makes the pools passive (for a machine shared with other busy processes).

    own_kernels: the graph runs specc's Int4Gemm, which splits its work over threads of its own: a pool
    spinning beside them would hold the cores they need, so that session's pool is passive and the kernel
    library is registered.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.intra_op_num_threads = usable_cores()
    so.inter_op_num_threads = 1
    spin = os.environ.get("SPECC_ORT_SPIN", "1") != "0" and not own_kernels
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if own_kernels:
        from ..kernels import register_with

        register_with(so)  # specc's own library, installed with the package: the bundle brings no code
    return so


class OnnxRuntimeBackend:
    name = "onnxruntime"
    runs_bundle_code = None  # ONNX graphs are data; ONNX Runtime loads no custom-op libraries from a bundle

    def __init__(self):
        # program -> the graph directory holding its plain ONNX export: a second role lowered from the
        # same program (the quantized draft) copies that export instead of exporting again
        self._exported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
        earlier = self._exported.get(program)
        if earlier is not None and (earlier / FILE).is_file():
            for name in sorted(p.name for p in earlier.iterdir()):
                shutil.copyfile(earlier / name, out_dir / name)
        else:
            export_onnx(program, path, input_names, output_names, OPSET)
            feed_cache_by_layer(path)
        entry, facts = FILE, cache_layout(path)  # of the graph exported here or copied from an earlier lowering
        if options.keys_at_positions and options.weight_quant is None:  # a quantised target's pipeline does it too
            facts.update(attend_at_positions(path))
        files = sorted(p.name for p in out_dir.iterdir())
        if options.weight_quant is not None:
            entry = NBITS_FILE
            facts["weight_quant"] = quantize_blocks(path, out_dir / entry, options.weight_quant)
            for name in files:
                (out_dir / name).unlink()
            files = sorted(p.name for p in out_dir.iterdir())
        elif options.quantize:
            entry = QUANTIZED_FILES[options.quantize]
            quantize(path, out_dir / entry, options.quantize)
            for name in files:
                (out_dir / name).unlink()
            files = sorted(p.name for p in out_dir.iterdir())
        if entry == FILE:
            self._exported[program] = out_dir
        versions = {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
        return {"entry": entry, "files": files, "versions": versions, "opset": opset_of(out_dir / entry),
                "fused_ops": fused_op_counts(out_dir / entry), **facts}

    def check_versions(self, recorded: dict) -> None:
        import onnxruntime

        require_version("onnxruntime", recorded, onnxruntime.__version__, same_minor=False)

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        import onnxruntime as ort

        check_external_data(graph_dir / entry["entry"], entry["files"])

        own_kernels = entry.get("weight_quant", {}).get("kind") == "int4-gemm"
        so = session_options(own_kernels=own_kernels)
        try:
            session = ort.InferenceSession(str(graph_dir / entry["entry"]), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's own exception types; the kernels' refusal of an older layout
            message = str(exc)
            if own_kernels and "Int4Gemm: these weights are packed in layout" in message:
                raise BundleError(f"{graph_dir.name}: {message[message.index('Int4Gemm:'):].strip()}") from None
            raise
        names, kv, layers = abi_inputs(session.get_inputs())
        check_engine_matches(entry, names, [o.name for o in session.get_outputs()], kv,
                             f"ONNX graph {graph_dir.name}/{entry['entry']}")
        return OrtRunner(session, [i["name"] for i in entry["inputs"]], list(entry["outputs"]), layers)


def feed_cache_by_layer(path: Path) -> None:
    """Give each layer its own cache inputs in the ONNX file at `path` (onnx_passes/feed_cache_by_layer.py);
    the weights' external data is untouched."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    run_onnx_passes(model, [FeedCacheByLayer()])
    onnx.save(model, str(path))


# A float32 target's passes of more tokens than this (prefill chunks) keep ONNX Runtime's fused attention, which
# does not write out a chunk's scores; verify passes are narrower, so they give a token a 1-token pass's bits.
FUSED_ABOVE = 64


def attend_at_positions(path: Path) -> dict:
    """Attention nodes of the float32 ONNX graph at `path` rewritten to read each key at its token's position in
    passes of up to FUSED_ABOVE tokens (onnx_passes/attend_at_cache_positions.py), in place; the weights'
    external data is untouched. Returns the manifest facts."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    facts = run_onnx_passes(model, [AttendAtCachePositions(fused_above=FUSED_ABOVE)])
    if facts["attention_at_positions"]:
        onnx.save(model, str(path))
    return facts


def cache_layout(path: Path) -> dict:
    """Manifest facts on how the graph at `path` takes its cache: {"cache_by_layer": L} when by layer."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    layers = sum(1 for i in model.graph.input if stacked_input(i.name) == "k_cache")
    return {"cache_by_layer": layers} if layers else {}


def abi_inputs(inputs) -> tuple[list[str], list, dict[str, int]]:
    """A session's inputs as the step-graph ABI names them: per-layer cache inputs (`k_cache.0` ...) folded
    back into their stacked name. Returns the names, the stacked k_cache shape, and the layers of each
    stacked input the runner feeds by layer."""
    names, layers, kv = [], {}, []
    for value in inputs:
        stacked = stacked_input(value.name)
        if stacked is not None:
            if stacked not in layers:
                names.append(stacked)
                if stacked == "k_cache":
                    kv = [None, *value.shape]
            layers[stacked] = layers.get(stacked, 0) + 1
        else:
            names.append(value.name)
            if value.name == "k_cache":
                kv = list(value.shape)
    if kv and "k_cache" in layers:
        kv[0] = layers["k_cache"]
    return names, kv, layers


def check_external_data(path: Path, files: list[str]) -> None:
    """Every external-data file the ONNX graph names is one of the graph's listed files (ONNX Runtime
    would open whatever path the graph gives; recent versions refuse only paths outside the folder)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise BundleError(f"{path.parent.name}/{path.name} is not a readable ONNX graph: {type(exc).__name__}: {exc}") from None
    graphs, tensors = [model.graph], []
    while graphs:
        graph = graphs.pop()
        tensors += list(graph.initializer) + [s.values for s in graph.sparse_initializer]
        for node in graph.node:
            for attr in node.attribute:
                graphs += ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
                tensors += ([attr.t] if attr.HasField("t") else []) + list(attr.tensors)
    seen = {e.value for t in tensors if uses_external_data(t) for e in t.external_data if e.key == "location"}
    unlisted = sorted(seen - set(files))
    if unlisted:
        raise BundleError(f"{path.parent.name}/{path.name} reads external data from {unlisted}, which are not the "
                          f"graph's listed files {files}")


def quantize(src: Path, dst: Path, kind: str) -> None:
    """Weight quantisation of every MatMul with a constant weight (the LM head included).

    int8: dynamic quantisation (MatMulInteger; activations quantised at run time).
    int4: blockwise 4-bit weights (MatMulNBits, blocks of 128, int8 compute), ORT's
    fastest single-token kernels on CPU.
    """
    import onnx

    model = onnx.load(str(src))
    FoldWeightTransposes()(model)
    if kind == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
        quantizer = MatMulNBitsQuantizer(model, block_size=128, is_symmetric=True, accuracy_level=4, bits=4)
        quantizer.process()
        quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folded = src.with_name("folded.onnx")
    onnx.save(model, str(folded), save_as_external_data=True, location=folded.name + ".data")
    root = logging.getLogger()  # the quantiser logs a pre-processing tip on the root logger
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(folded), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                         op_types_to_quantize=["MatMul", "Gemm"], use_external_data_format=True)
    finally:
        root.setLevel(level)
    for path in (folded, folded.with_name(folded.name + ".data")):
        path.unlink()


def quantize_blocks(src: Path, dst: Path, config: QuantConfig) -> dict:
    """Target quantisation by the ONNX passes of `onnxruntime_target_pipeline` (specc/onnx_passes). Returns
    what the manifest records (settings, layer counts by format, weight bytes per pass, attention nodes
    rewritten)."""
    import onnx

    model = onnx.load(str(src))
    summary = run_onnx_passes(model, onnxruntime_target_pipeline(config))
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return {"keep_float": list(config.keep_float), **summary}


class OrtRunner:
    """Runs a session on the ABI's inputs; a stacked cache input the graph takes by layer (`layers`) is fed
    as its layer slices, which are views of the runtime's contiguous cache tensor, not copies."""

    def __init__(self, session, input_names: list[str], output_names: list[str], layers: dict[str, int] | None = None):
        self.session, self.input_names, self.output_names = session, input_names, output_names
        self.layers = layers or {}

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        feeds = {}
        for name, t in zip(self.input_names, inputs):
            array = np.ascontiguousarray(t.numpy())
            if name in self.layers:
                feeds.update(by_layer(name, array, self.layers[name]))
            else:
                feeds[name] = array
        return [torch.from_numpy(o) for o in self.session.run(self.output_names, feeds)]


BACKEND = OnnxRuntimeBackend()
