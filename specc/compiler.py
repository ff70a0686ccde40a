"""`specc compile`: recipe → models → step graphs → passes → engines → bundle."""
from __future__ import annotations

import dataclasses
import errno
import json
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .version import __version__
from .backends import LowerOptions, get_backend
from .backends.profiles import ShapePlan, dim_sizes, plan_profiles, step_tokens
from .bundle import BundleWriter
from .capture.shapes import ModelDims, dim_ranges, example_inputs
from .capture.graph import StepGraph, capture
from .errors import ModelError, RecipeError, SpeccError
from .heads.graph import capture_head
from .heads.store import load_head
from .limits import auto_k_max
from .models.load import check_same_tokenizer, gguf_source, load_model, resolve_source
from .onnx_passes import QuantConfig
from .passes import build_pipeline
from .progress import Stages
from .methods import get_method
from .recipe import Recipe, tree_nodes

# max |engine - eager| / max(1, max |eager|) over every output, by engine precision (eager runs the traced dtype)
NUMERICS_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
LOW_DISK = 64 * 2**20  # bytes: less free space than this after a failed write means the disk filled up


@dataclass
class PlannedGraph:
    graph: StepGraph
    options: LowerOptions
    lower_from: str  # role whose exported program is lowered (a quantised target reuses "target")


def _eos_ids(loaded) -> list[int]:
    ids = loaded.model.generation_config.eos_token_id if loaded.model.generation_config else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.append(loaded.tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def _compare(graph: StepGraph, runner, options: LowerOptions) -> dict:
    """Run eager and engine on the same random inputs; return the error figures."""
    tolerance = NUMERICS_TOLERANCE[options.precision]
    quantized = options.quantize is not None or options.weight_quant is not None
    torch.manual_seed(0)
    device = graph.inputs[0].example.device
    inputs = example_inputs(graph.dims, getattr(torch, graph.dims.dtype), batch=2, tokens=3, cache=5, device=device)
    if [i.name for i in graph.inputs[:len(inputs)]] == list(inputs):
        args = [inputs[i.name] for i in graph.inputs[:len(inputs)]] + [i.example for i in graph.inputs[len(inputs):]]
    else:  # a draft head (heads/graph.py): its own traced examples
        args = [i.example for i in graph.inputs]
    with torch.no_grad():
        eager = graph.gm(*args)
    got = runner(*args)
    worst = 0.0
    for name, a, b in zip(graph.outputs, eager, got):
        a, b = a.detach().float().cpu(), b.float().cpu()
        if a.shape != b.shape:
            raise SpeccError(f"{graph.role} engine output {name!r} has shape {tuple(b.shape)}, eager torch {tuple(a.shape)}")
        if a.numel():
            worst = max(worst, ((a - b).abs().max() / max(1.0, a.abs().max().item())).item())
    result = {"max_rel_diff": worst, "tolerance": tolerance, "inputs": "random, batch 2, tokens 3, cache 5"}
    if quantized:
        result["top1_agreement"] = (eager[0].argmax(-1) == got[0].argmax(-1)).float().mean().item()
    elif worst > tolerance:
        raise SpeccError(
            f"{graph.role} engine differs from eager torch by {worst:.2e} (relative), above {tolerance:.0e} "
            f"({options.precision}); "
            "the lowering is wrong, the bundle was not written"
        )
    return result


def compile_recipe(recipe: Recipe, output: str | Path | None = None, dump_graphs: str | Path | None = None,
                   progress: bool = True) -> Path:
    """Build the bundle a recipe describes; returns its path. Nothing is written on failure."""
    from transformers.utils import logging as hf_logging

    backend = get_backend(recipe.backend)
    recipe = resolve_context(recipe)
    check_model_fits(recipe)
    writer = BundleWriter(Path(output or recipe.output))
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not progress:  # transformers draws its own bars while loading weights; restored below
        hf_logging.disable_progress_bar()
    method = get_method(recipe.draft.method)
    draft_graph = method.graph is not None
    n_stages = 6 + (method.graph == "model") + (2 if draft_graph else 0)
    stages = Stages(n_stages, f"compile → {recipe.backend}", enabled=progress)
    ranges = dim_ranges(recipe.limits.max_batch, recipe.limits.max_context)
    base_options = LowerOptions(precision=recipe.precision, device=recipe.device, tensorrt=recipe.tensorrt)
    try:
        with stages.stage("load target"):
            target = load_model(recipe.target.model, recipe.target.dtype, recipe.device)
        draft = None
        if method.graph == "model":
            with stages.stage("load draft"):
                draft = load_model(recipe.draft.model, recipe.target.dtype, recipe.device)
                check_same_tokenizer(target.tokenizer, draft.tokenizer, recipe.target.model, recipe.draft.model)

        with stages.stage("export target"):
            target_options = dataclasses.replace(base_options, weight_quant=_target_quant(recipe), keys_at_positions=True)
            plan = {"target": PlannedGraph(capture("target", target.model, ranges), target_options, "target")}
        head = None
        if draft_graph:
            with stages.stage("export draft"):
                if method.graph == "head":
                    head = _load_head(recipe, target)[0]
                plan["draft"] = _plan_draft(recipe, plan["target"].graph, target, draft, base_options, ranges, head)

        with stages.stage("passes"):
            for role, planned in plan.items():
                if planned.lower_from == role:
                    vocab = draft_vocab_ids(recipe, target.tokenizer, planned.graph.dims.vocab_size) \
                        if role == "draft" else None
                    for graph_pass in build_pipeline(recipe, role, planned.graph.head.get("hidden_size"), head, vocab):
                        graph_pass(planned.graph)
            if dump_graphs:
                _dump(plan, Path(dump_graphs))

        entries = _lower_and_verify(recipe, plan, backend, writer, stages)

        with stages.stage("write bundle"):
            target.tokenizer.save_pretrained(writer.root / "tokenizer")
            path = writer.finish(_manifest(recipe, target, draft, entries, stages.timings))[0]
    except OSError as exc:
        full = _disk_full(writer.root, exc)
        writer.abort()
        if full:
            raise SpeccError(full) from None
        raise
    except BaseException:
        writer.abort()
        raise
    finally:
        stages.close()
        if hf_bars:
            hf_logging.enable_progress_bar()
    return path


def _disk_full(root: Path, exc: OSError) -> str | None:
    """A message naming a full disk as the cause of `exc`, raised while writing the bundle at `root`. Some
    writers (numpy's `tofile`, under ONNX's external data) raise an OSError without an errno for it, so
    the free space decides too."""
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        return None
    if exc.errno != errno.ENOSPC and free >= LOW_DISK:
        return None
    return (f"no space left on the disk of {root} while writing the bundle ({free / 2**20:.0f} MiB free; {exc}); "
            "the partial bundle was removed. A bundle takes about the weights' size per graph (float32: 4 bytes a "
            "parameter): free space there or compile to another directory (-o)")


MAX_CONTEXT = 131072  # the recipe's upper bound of limits.max_context


def model_window(source: str) -> int | None:
    """A model's own context window (config.json max_position_embeddings), or None where it gives none."""
    try:
        config = json.loads((resolve_source(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if "max_position_embeddings" not in config else config
    window = config.get("max_position_embeddings")
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def resolve_context(recipe: Recipe) -> Recipe:
    """limits.max_context "model" as a number: the target's context window (and the draft model's, if smaller)."""
    if recipe.limits.max_context != "model":
        return recipe
    draft_model = get_method(recipe.draft.method).graph == "model" and recipe.draft.model
    sources = [recipe.target.model] + ([recipe.draft.model] if draft_model else [])
    windows = [model_window(s) for s in sources]
    if windows[0] is None:
        raise RecipeError("limits.max_context", f"{recipe.target.model!r} does not state its context window "
                          "(config.json max_position_embeddings); give limits.max_context as a number")
    window = min([MAX_CONTEXT] + [w for w in windows if w is not None])
    return dataclasses.replace(recipe, limits=dataclasses.replace(recipe.limits, max_context=window))


def check_model_fits(recipe: Recipe) -> None:
    """Recipe fields checked against the target's config.json before any weights load (draft.layer)."""
    if get_method(recipe.draft.method).graph != "exit":
        return
    config_path = resolve_source(recipe.target.model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        config = config.get("text_config", config) if "num_hidden_layers" not in config else config
        n_layers = config["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{config_path} does not give num_hidden_layers ({type(exc).__name__}: {exc})") from None
    if not isinstance(n_layers, int) or not 1 <= recipe.draft.layer < n_layers:
        raise RecipeError("draft.layer", f"{recipe.draft.layer} is out of range for {recipe.target.model!r}, which has "
                          f"{n_layers} layers; allowed: 1 to {n_layers - 1 if isinstance(n_layers, int) else '?'}")


def _lower_and_verify(recipe: Recipe, plan: dict[str, PlannedGraph], backend, writer: BundleWriter,
                      stages: Stages) -> dict[str, dict]:
    """Lower every planned graph with the backend, reload it and compare it with eager torch; the manifest's
    graph entries by role."""
    programs, entries = {}, {}
    for role, planned in plan.items():
        with stages.stage(f"lower {role}"):
            source = plan[planned.lower_from].graph
            if planned.lower_from not in programs:
                programs[planned.lower_from] = source.export()
            previous = writer.output / role
            planned.options = dataclasses.replace(planned.options, shapes=shape_plan(recipe, role, source),
                                                  previous_dir=previous if previous.is_dir() else None)
            entries[role] = backend.lower(programs[planned.lower_from], writer.graph_dir(role),
                                          [i.name for i in source.inputs], source.outputs, planned.options)
    with stages.stage("verify numerics"):
        for role, planned in plan.items():
            graph = plan[planned.lower_from].graph
            entry = _graph_entry(role, graph, entries[role], planned)
            runner = backend.load(writer.graph_dir(role), entry, planned.options)
            entry["numerics"] = _compare(graph, runner, planned.options)
            entries[role] = entry
    return entries


def _manifest(recipe: Recipe, target, draft, entries: dict[str, dict], timings) -> dict:
    """The bundle's manifest.json (bundle/manifest.py reads it back as a typed Manifest)."""
    method = get_method(recipe.draft.method)
    return {
        "backend": recipe.backend,
        "recipe": recipe.to_dict(),
        "versions": _versions(entries),
        "models": {"target": str(target.source), "draft": str(draft.source) if draft else None},
        "draft": {"method": method.name, "graph": "draft" if method.graph is not None else None,
                  "shares_target_cache": method.shares_target_cache, "layer": recipe.draft.layer,
                  "adapter": _adapter_info(recipe), "head": _head_info(recipe)},
        "tokenizer": {"dir": "tokenizer", "eos_token_ids": _eos_ids(target)},
        "graphs": entries,
        "compile_seconds": timings,
    }


def _plan_draft(recipe: Recipe, target_graph: StepGraph, target, draft, base: LowerOptions, ranges,
                head: torch.nn.Module | None) -> PlannedGraph:
    kind = get_method(recipe.draft.method).graph
    quant = dataclasses.replace(base, quantize=recipe.draft.quantize)
    if recipe.draft.quantize == "int4-gemm":  # the target's pipeline, on the draft graph
        quant = dataclasses.replace(base, weight_quant=_draft_quant(recipe, kind), keys_at_positions=True)
    if kind == "target":
        if recipe.speculation.verify_head:  # the target graph gets the head; the draft needs its logits
            return PlannedGraph(capture("draft", target.model, ranges), quant, "draft")
        return PlannedGraph(target_graph, quant, "target")
    if kind == "model":
        return PlannedGraph(capture("draft", draft.model, ranges), quant, "draft")
    if kind == "exit":  # the target traced again; passes cut it after draft.layer
        return PlannedGraph(capture("draft", target.model, ranges), quant, "draft")
    if kind == "head":  # a learned head over the target's features (passes/add_feature_outputs.py)
        return PlannedGraph(capture_head("draft", head, ranges), quant, "draft")
    raise SpeccError(f"draft.method {recipe.draft.method!r} has draft graph kind {kind!r}, which the compiler cannot build")


def draft_vocab_ids(recipe: Recipe, tokenizer, vocab_size: int) -> list[int] | None:
    """The token ids a draft model's LM head keeps (draft.vocab): the first draft.vocab ids and every special token,
    ascending; None for the whole vocabulary."""
    n = recipe.draft.vocab
    if n is None:
        return None
    if n >= vocab_size:
        raise RecipeError("draft.vocab", f"{n} keeps the whole vocabulary of {recipe.draft.model!r} ({vocab_size} "
                          f"tokens); allowed: 1 to {vocab_size - 1}, or null")
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    eos = tokenizer.eos_token_id
    special |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(set(range(n)) | {i for i in special if 0 <= i < vocab_size})


def _load_head(recipe: Recipe, target) -> tuple[torch.nn.Module, dict]:
    head, config = load_head(recipe.draft.head, target.model)
    if config["kind"] != recipe.draft.method:
        raise SpeccError(f"draft.head {recipe.draft.head} is a {config['kind']} head, "
                         f"but draft.method is {recipe.draft.method!r}")
    return head, config


def _head_info(recipe: Recipe) -> dict | None:
    """What the manifest records about a Medusa/EAGLE head (its weights are inside the draft graph)."""
    if get_method(recipe.draft.method).graph != "head":
        return None
    head = Path(recipe.draft.head)
    config = json.loads((head / "config.json").read_text())
    card = json.loads((head / "card.json").read_text()) if (head / "card.json").is_file() else None
    return {"source": head.name, "config": config,
            "held_out": card.get("held_out") if card else None,
            "heads": config.get("medusa_num_heads")}


def _target_quant(recipe: Recipe) -> QuantConfig | None:
    """MatMulNBits settings for target.quantize, with a GGUF source's own blocks where they map exactly."""
    spec = recipe.target
    if not spec.quantize:
        return None
    bits = {"int8": 8, "int4": 4, "fp8": 8, "int8-gemm": 8, "int4-gemm": 4}[spec.quantize]
    config = QuantConfig(bits, spec.block_size, spec.accuracy_level, True, tuple(spec.keep_float), spec.quantize)
    keeps_blocks = spec.gguf_blocks and recipe.backend == "onnxruntime" and spec.quantize != "int8-gemm"
    gguf = gguf_source(spec.model) if keeps_blocks else None
    if gguf is not None:
        from .models.gguf_blocks import read_gguf_blocks

        config.imported = read_gguf_blocks(gguf, bits, tuple(spec.gguf_requantize))
    return config


def _draft_quant(recipe: Recipe, kind: str) -> QuantConfig:
    """Int4Gemm settings for draft.quantize: int4-gemm, with a GGUF draft model's own Q4 blocks where they map exactly."""
    config = QuantConfig(4, kind="int4-gemm")
    gguf = gguf_source(recipe.draft.model) if kind == "model" else None
    if gguf is not None:
        from .models.gguf_blocks import read_gguf_blocks

        config.imported = read_gguf_blocks(gguf, 4)
    return config


def _adapter_info(recipe: Recipe) -> dict | None:
    if not recipe.draft.adapter:
        return None
    from .heads.exit import adapter_metadata

    meta = adapter_metadata(recipe.draft.adapter)
    return {"file": Path(recipe.draft.adapter).name, "info": json.loads(meta["info"])}


def shape_plan(recipe: Recipe, role: str, graph: StepGraph) -> ShapePlan:
    """The shape profiles of one graph (backends/profiles.py), from the recipe's limits and speculation."""
    spec = recipe.speculation
    ranges = {name: tuple(r) for name, r in graph.ranges.to_dict().items()}
    inputs = graph.signature()["inputs"]
    example = dim_sizes(inputs, [i.example.shape for i in graph.inputs])
    return ShapePlan(inputs, plan_profiles(ranges, step_tokens(role, spec.mode,
                                                               auto_k_max(spec.k) if spec.k == "auto" else spec.k,
                                                               tree_nodes(recipe))), example)


def _graph_entry(role: str, graph: StepGraph, lowered: dict, planned: PlannedGraph) -> dict:
    return {
        "dir": role,
        **lowered,
        **graph.signature(),
        "ranges": graph.ranges.to_dict(),
        "model": graph.dims.to_dict(),
        "quantize": planned.options.quantize or _bits_name(planned.options.weight_quant),
        "passes": list(graph.notes),
        **({"vocab_ids": _ranges(graph.vocab_ids)} if graph.vocab_ids is not None else {}),
    }


def _ranges(ids: list[int]) -> list[list[int]]:
    """Ascending ids as [first, last] runs: a head kept for the first 32,000 ids and a few special ones is a few
    pairs in the manifest, not a list of 32,000."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def _bits_name(config: QuantConfig | None) -> str | None:
    return None if config is None else config.kind or f"int{config.bits}"


def _versions(entries: dict) -> dict:
    versions = {"specc": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for entry in entries.values():
        versions.update(entry.get("versions", {}))
    return versions


def _dump(plan: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for role, planned in plan.items():
        if planned.lower_from == role:
            (directory / f"{role}.json").write_text(json.dumps(planned.graph.summary(), indent=2, default=str))
            (directory / f"{role}.py").write_text(planned.graph.gm.code)


__all__ = ["compile_recipe", "ModelDims"]
