"""Running a TensorRT engine on torch CUDA tensors with `execute_async_v3`.

Each call reads the sizes of its dynamic dimensions, switches to the smallest optimization
profile holding them, sets input shapes and addresses (the KV cache is bound where it
lies: no copy), allocates the outputs from torch's caching allocator (no device allocation
per call once warm; fresh tensors, because the runtime keeps a graph's outputs across its
next call) and enqueues on torch's current stream, so torch ops before and after are
ordered with the engine without synchronising.

With `cuda_graphs`, calls that fit the `step` profile (draft steps, verify) replay a CUDA
graph captured for their exact shapes and cache addresses: the small inputs are copied into
the graph's static buffers, the cache is read in place (the runtime commits into it in
place, and a grown cache has a new address and gets a new graph), and the outputs are
cloned out. Each graph owns an execution context, as a captured enqueue fixes the
context's shapes and addresses; at most MAX_GRAPHS are kept.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import SpeccError
from .profiles import Profile, dim_sizes, select_profile

CACHE_INPUTS = ("k_cache", "v_cache")  # bound in place in CUDA graphs (step-graph ABI)
MAX_GRAPHS = 16


def torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.INT32: torch.int32,
             trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool, trt.DataType.INT8: torch.int8,
             trt.DataType.UINT8: torch.uint8, trt.DataType.BF16: torch.bfloat16}
    if dtype not in table:
        raise SpeccError(f"TensorRT tensor type {dtype} has no torch equivalent in specc")
    return table[dtype]


class _Context:
    """An execution context bound to one profile, with its input and output tensors."""

    def __init__(self, engine, strategy=None):
        self.context = engine.create_execution_context(strategy) if strategy is not None else engine.create_execution_context()
        if self.context is None:
            raise SpeccError("TensorRT could not create an execution context (out of GPU memory?)")
        self.profile: int | None = None  # set on the first call, which also allocates per-profile memory

    def bind(self, profile: int, stream: torch.cuda.Stream, names: list[str], inputs: list[torch.Tensor],
             output_names: list[str], output_dtypes: dict, device: torch.device) -> list[torch.Tensor]:
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, stream.cuda_stream)
            self.profile = profile
        for name, tensor in zip(names, inputs):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in output_names:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=output_dtypes[name], device=device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        return outputs

    def execute(self, stream: torch.cuda.Stream) -> None:
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise SpeccError("TensorRT execution failed (execute_async_v3 returned False); its log says why")


class _Captured:
    """A CUDA graph of one engine call: static small inputs, cache bound in place, fixed outputs."""

    def __init__(self, runner: "TrtRunner", profile: int, inputs: list[torch.Tensor]):
        self.ctx = _Context(runner.engine, runner.graph_strategy)
        self.static = [t if name in CACHE_INPUTS else t.clone() for name, t in zip(runner.input_names, inputs)]
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):
            self.outputs = runner.bind(self.ctx, profile, stream, self.static)
            self.ctx.execute(stream)  # TensorRT finishes lazy set-up on the first enqueue, outside the capture
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.ctx.execute(stream)
        torch.cuda.current_stream(runner.device).wait_stream(stream)

    def replay(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        for static, tensor in zip(self.static, inputs):
            if static.data_ptr() != tensor.data_ptr():
                static.copy_(tensor)
        self.graph.replay()
        return [o.clone() for o in self.outputs]


class TrtRunner:
    """A deserialized engine as a step-graph Runner: positional CUDA tensors in, CUDA tensors out."""

    def __init__(self, trt, engine, inputs: list[dict], output_names: list[str], profiles: list[Profile],
                 device: torch.device, cuda_graphs: bool = False, keepalive: tuple = ()):
        self.engine, self.keepalive = engine, keepalive  # the runtime and its logger must outlive the engine
        self.inputs, self.input_names = inputs, [i["name"] for i in inputs]
        self.output_names, self.profiles, self.device = output_names, profiles, device
        self.input_dtypes = {n: torch_dtype(trt, engine.get_tensor_dtype(n)) for n in self.input_names}
        self.output_dtypes = {n: torch_dtype(trt, engine.get_tensor_dtype(n)) for n in output_names}
        if engine.num_optimization_profiles != len(profiles):
            raise SpeccError(f"the engine has {engine.num_optimization_profiles} optimization profiles, the manifest "
                             f"lists {len(profiles)}; the bundle is inconsistent, compile it again")
        self.main = _Context(engine)
        self.cuda_graphs = cuda_graphs
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        self.graph_strategy = strategy.ON_PROFILE_CHANGE if strategy is not None else None
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()

    def bind(self, ctx: _Context, profile: int, stream, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return ctx.bind(profile, stream, self.input_names, inputs, self.output_names, self.output_dtypes, self.device)

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        if len(inputs) != len(self.input_names):
            raise SpeccError(f"the engine takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                             f"got {len(inputs)}")
        inputs = [t.to(self.device, self.input_dtypes[n]).contiguous() for n, t in zip(self.input_names, inputs)]
        profile = select_profile(self.profiles, dim_sizes(self.inputs, [t.shape for t in inputs]))
        if self.cuda_graphs and self.profiles[profile].name == "step":
            return self._replay(profile, inputs)
        stream = torch.cuda.current_stream(self.device)
        outputs = self.bind(self.main, profile, stream, inputs)
        self.main.execute(stream)
        return outputs

    def _replay(self, profile: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        key = (profile, *(tuple(t.shape) for t in inputs),
               *(t.data_ptr() for n, t in zip(self.input_names, inputs) if n in CACHE_INPUTS))
        captured = self.graphs.pop(key, None) or _Captured(self, profile, inputs)
        self.graphs[key] = captured
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return captured.replay(inputs)
