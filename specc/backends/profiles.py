"""Shape profiles: the min / opt / max of every dynamic dimension a graph's engine is built for.

Engines that tune kernels per shape range (TensorRT optimization profiles, Torch-TensorRT
inputs) get their ranges from here. Each graph gets two profiles, both inside the graph's
declared ranges (`limits.max_batch`, `limits.max_context`):

- `step` — the calls that repeat every round: draft steps and the target's verify (or
  target-only decode). tokens and rows 1..S, with S = k+1 for a chain target, tree
  max_nodes+1 for a tree target, and 2 for a draft (the pending token plus, after a fully
  accepted round, the last draft). opt: S tokens for the target (verify), 1 for the draft.
- `prefill` — the whole declared range (tokens and rows 1..max_context), so every shape the
  graph admits has a profile: prompts, and verify with a larger k than the recipe's.
  opt: PREFILL_OPT_TOKENS tokens, 1 row (prefill reads the last position only).

Both: batch 1..max_batch (opt max_batch: tuned for the full batch), cache 1..max_context
(opt half of max_context, in whole 64-slot KV blocks). Dimensions that passes add get their
declared range, opt = min. At run time `select_profile` picks the smallest profile holding
the call's sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeccError

PREFILL_OPT_TOKENS = 128
KV_BLOCK = 64  # runtime/kv_cache.BLOCK: the cache grows in these steps


@dataclass(frozen=True)
class Profile:
    name: str
    dims: dict[str, tuple[int, int, int]]  # dimension -> (min, opt, max)

    def contains(self, sizes: dict[str, int]) -> bool:
        return all(lo <= sizes[d] <= hi for d, (lo, _, hi) in self.dims.items() if d in sizes)

    def volume(self) -> int:
        out = 1
        for lo, _, hi in self.dims.values():
            out *= hi - lo + 1
        return out

    def input_shapes(self, shape: list) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of an input whose signature shape names its dynamic axes."""
        pick = lambda i: tuple(self.dims[s][i] if isinstance(s, str) else int(s) for s in shape)
        return pick(0), pick(1), pick(2)

    def to_dict(self) -> dict:
        return {"name": self.name, "dims": {d: list(v) for d, v in self.dims.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        return cls(data["name"], {d: tuple(v) for d, v in data["dims"].items()})


@dataclass(frozen=True)
class ShapePlan:
    """What a shape-specialising backend needs: the inputs' signatures and the profiles."""

    inputs: list[dict]  # graph signature entries: {"name", "dtype", "shape": [dim name | int]}
    profiles: tuple[Profile, ...]
    example: dict[str, int]  # sizes of the capture's example inputs (none is 0 or 1, so torch.export keeps them dynamic)

    def example_shape(self, shape: list) -> tuple[int, ...]:
        return tuple(self.example[s] if isinstance(s, str) else int(s) for s in shape)

    def union(self) -> Profile:
        """One profile spanning all (for backends with a single range per input); opt from the first."""
        first = self.profiles[0]
        dims = {d: (min(p.dims[d][0] for p in self.profiles), first.dims[d][1], max(p.dims[d][2] for p in self.profiles))
                for d in first.dims}
        return Profile("+".join(p.name for p in self.profiles), dims)


def step_tokens(role: str, mode: str, k: int, tree_max_nodes: int) -> tuple[int, int]:
    """(max, opt) tokens of the repeated calls of a graph: see the module docstring."""
    if role == "draft":
        return 2, 1
    size = k + 1 if mode == "chain" else tree_max_nodes + 1
    return size, size


def plan_profiles(ranges: dict[str, tuple[int, int]], step: tuple[int, int]) -> tuple[Profile, Profile]:
    """The `step` and `prefill` profiles for a graph with these declared [min, max] ranges."""
    batch_lo, batch_hi = ranges["batch"]
    cache_lo, cache_hi = ranges["cache"]
    cache_opt = _clamp(-(-(cache_hi // 2) // KV_BLOCK) * KV_BLOCK, cache_lo, cache_hi)
    common = {"batch": (batch_lo, batch_hi, batch_hi), "cache": (cache_lo, cache_opt, cache_hi)}
    for name, (lo, hi) in ranges.items():
        if name not in ("batch", "cache", "tokens", "rows"):
            common[name] = (lo, lo, hi)

    def span(name: str, top: int, opt: int) -> tuple[int, int, int]:
        lo, hi = ranges[name]
        top = _clamp(top, lo, hi)
        return lo, _clamp(opt, lo, top), top

    step_max, step_opt = step
    step_dims = {"tokens": span("tokens", step_max, step_opt), "rows": span("rows", step_max, step_opt)}
    prefill_dims = {"tokens": span("tokens", ranges["tokens"][1], PREFILL_OPT_TOKENS),
                    "rows": span("rows", ranges["rows"][1], 1)}
    return Profile("step", {**common, **step_dims}), Profile("prefill", {**common, **prefill_dims})


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def dim_sizes(inputs: list[dict], shapes: list[tuple[int, ...]]) -> dict[str, int]:
    """The size of every named dimension in one call, checked to agree between inputs."""
    sizes: dict[str, int] = {}
    for spec, shape in zip(inputs, shapes):
        if len(shape) != len(spec["shape"]):
            raise SpeccError(f"input {spec['name']!r} has shape {tuple(shape)}, the graph expects {spec['shape']}")
        for axis, dim in enumerate(spec["shape"]):
            size = int(shape[axis])
            if isinstance(dim, str):
                if sizes.setdefault(dim, size) != size:
                    raise SpeccError(f"dimension {dim!r} is {sizes[dim]} in one input and {size} in {spec['name']!r}")
            elif size != dim:
                raise SpeccError(f"input {spec['name']!r} axis {axis} is {size}, the graph fixes it at {dim}")
    return sizes


def select_profile(profiles: list[Profile] | tuple[Profile, ...], sizes: dict[str, int]) -> int:
    """Index of the smallest profile that holds these sizes; a SpeccError naming them if none does."""
    fitting = [i for i, p in enumerate(profiles) if p.contains(sizes)]
    if not fitting:
        ranges = "; ".join(f"{p.name}: " + ", ".join(f"{d} {lo}..{hi}" for d, (lo, _, hi) in p.dims.items())
                           for p in profiles)
        raise SpeccError(f"no engine profile holds the call's sizes {sizes} (profiles: {ranges}); "
                         "compile with larger limits")
    return min(fitting, key=lambda i: profiles[i].volume())
