"""Human-readable tables: run statistics, manifests, and the machine report of `specc doctor`."""
from __future__ import annotations

import importlib
import platform
from pathlib import Path

from ..bench.table import fmt, table
from ..errors import SpeccError, escape_control
from ..limits import context_cost, kv_bytes_per_token
from ..methods import get_method
from ..onnx_passes import ATTENTION_FORMS


def format_run_stats(stats: dict, speculative: bool, front: str | None = None) -> str:
    """The stats table of `specc generate`; front (the drafter in front of a draft model: "prompt lookup",
    "suffix") adds the split between its rounds and the model's."""
    rows = [
        ["new tokens", stats["new_tokens"]],
        ["seconds", stats["seconds"]],
        ["tokens/s", stats["tokens_per_second"]],
        ["prefill / draft / target / host s",
         " / ".join(f"{stats[k]:.3f}" for k in ("prefill_seconds", "draft_seconds", "target_seconds", "host_seconds"))],
    ]
    if speculative:
        rows += [
            ["acceptance rate", stats["acceptance_rate"]],
            ["accepted drafts per round", stats["accepted_per_round"]],
            ["tokens per target pass", stats["tokens_per_target_pass"]],
            ["acceptance by position", " ".join(f"{a:.2f}" for a in stats["acceptance_by_position"] if a is not None)],
        ]
        if front:
            rows.append([f"{front} rounds (acceptance)",
                         f"{stats['front_rounds']} of {stats['rounds']} ({fmt(stats['front_acceptance_rate'])}; "
                         f"model rounds {fmt(stats['model_acceptance_rate'])})"])
    return table(["stat", "value"], rows, "ll")


def terminal_safe(text: str) -> str:
    """Text with control characters (terminal escape sequences from a manifest or a file name)
    escaped, so what specc prints cannot rewrite the terminal; its own line breaks stay. Text that
    echoes input line by line escapes each line with `escape_control` instead (a newline inside a
    value must not start a line of its own)."""
    return escape_control(text, keep="\n")


def _attention_form(q: dict) -> str:
    """How a quantised graph keeps attention rows independent of the pass size (onnx_passes/)."""
    forms = [(q.get(key, 0), text) for key, text in ATTENTION_FORMS.items()]
    return "attention " + " and ".join(f"{text} ({n} nodes)" for n, text in forms if n) if any(n for n, _ in forms) \
        else "no attention rewritten"


def _pass_rows(q: dict) -> str:
    """The compiling CPU's row-invariance probe in words (the runtime probes again where it runs)."""
    rows = q.get("min_pass_rows", 1 if q.get("rows_independent_of_pass_size") else None)
    return {1: "yes", 2: "from 2 rows (1-token passes run as 2 rows)"}.get(rows, "no")


def format_manifest(manifest, path: Path, verified: bool) -> str:
    """`specc inspect`: a bundle's typed Manifest (specc.bundle) as text, its id first."""
    recipe = manifest.recipe
    checked = "every file listed, sizes and sha256 match" if verified else "files listed, sizes match, sha256 not checked"
    lines = [
        f"id          {manifest.id}  (pin it: specc generate --expect-id ID, specc.load(path, expect_id=ID))",
        f"bundle      {path}  ({checked})",
        f"format      {manifest.format} v{manifest.format_version}, specc {manifest.specc_version}",
        f"backend     {manifest.backend} on {recipe.device}, precision {recipe.precision}",
        f"target      {manifest.models['target']}",
        f"draft       {manifest.draft.method}" + (f" ({manifest.models['draft']})" if manifest.models.get("draft") else "")
        + (f", prompt lookup first (n-grams {recipe.draft.min_ngram}..{recipe.draft.max_ngram})" if recipe.draft.lookup else ""),
        f"speculation {recipe.speculation.mode}, k={recipe.speculation.k}",
        f"limits      max_batch {recipe.limits.max_batch}, max_context {recipe.limits.max_context}",
        "versions    " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items()),
    ]
    for role, g in manifest.graphs.items():
        size = sum(manifest.files[f"{g.dir}/{f}"].bytes for f in g.files)
        lines += ["", f"graph {role}: {g.dir}/{g.entry} ({size / 1e6:.1f} MB)"
                  + (f", quantize {g.quantize}" if g.quantize else "")]
        m = g.model
        lines.append(f"  model     {m['n_layers']} layers, {m['n_kv_heads']} kv heads x {m['head_dim']}, "
                     f"vocab {m['vocab_size']}, {m['dtype']}")
        if role != "draft" or get_method(manifest.draft.method).own_cache:  # heads and early exit keep none that size
            per_token = kv_bytes_per_token(m["n_layers"], m["n_kv_heads"], m["head_dim"], m["dtype"])
            lines.append("  memory    " + context_cost(per_token, recipe.limits.max_context, recipe.limits.max_batch))
        for i in g.inputs:
            lines.append(f"  in  {i.name:<14} {i.dtype:<8} {i.shape}")
        lines.append(f"  out {', '.join(g.outputs)}")
        lines.append("  ranges    " + ", ".join(f"{k} {v[0]}..{v[1]}" for k, v in g.ranges.items()))
        for note in g.passes:
            lines.append(f"  pass      {note}")
        lines += fact_lines(g.facts)
    return "\n".join(escape_control(line) for line in lines)  # a value's own newline stays inside its line


def fact_lines(facts: dict) -> list[str]:
    """The lines `inspect` prints for a graph's backend facts (quantisation, profiles, GPU, coverage, ...)."""
    lines = []
    for key in ("weight_quant", "attention_at_positions", "profiles", "profile", "compute_capability", "op_coverage",
                "fused_ops", "fallback", "numerics"):
        if key in facts:
            try:
                lines += _fact_lines(key, facts)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):  # backend facts are free-form
                lines.append(f"  {key:<9} {str(facts[key])[:200]}")
    return lines


def _fact_lines(key: str, g: dict) -> list[str]:
    if key in ("profiles", "profile"):
        profiles = g[key] if key == "profiles" else [g[key]]
        return [f"  profile   {p['name']}: " + ", ".join(f"{d} {lo}..{hi} (opt {opt})" for d, (lo, opt, hi) in p["dims"].items())
                for p in profiles]
    if key == "compute_capability":
        return [f"  gpu       {g.get('gpu')} (compute capability {g['compute_capability']}), precision {g.get('precision', '-')}"]
    if key == "op_coverage":
        c = g["op_coverage"]
        return [f"  coverage  {c['nodes']} ONNX nodes (opset {c['opset']}) checked against TensorRT {c['tensorrt_table']}'s "
                f"operator table: {len(c['unsupported'])} unsupported"]
    if key == "weight_quant":
        q = g["weight_quant"]
        merged = f", {q['merged_layers']} layers merged into one GEMM with another" if q.get("merged_layers") else ""
        if q.get("kind") == "int8-gemm":
            kernel = f"int8 per output channel, {q['kernel']}, activations per row in two int8 parts{merged}"
        elif q.get("kind") == "int4-gemm":
            kernel = f"int4 blocks of {q['block_size']}, {q['kernel']}{merged}"
        else:
            kernel = f"int{q['bits']} MatMulNBits, block {q['block_size']}, accuracy level {q['accuracy_level']}"
        return [f"  weights   {kernel}, "
                f"{q['weight_bytes'] / 1e6:.1f} MB read per pass, {_attention_form(q)}"
                + (f", SwiGLU in the kernel ({q['gated_in_kernel']} layers)" if q.get("gated_in_kernel") else "")
                + ", rows independent of pass size "
                f"(where compiled): {_pass_rows(q)}"
                + (f"; float32 kept: {', '.join(q['keep_float'])}" if q["keep_float"] else ""),
                "  layers    " + ", ".join(f"{n} {label}" for label, n in q["layers"].items())]
    if key == "attention_at_positions":
        wide = (f"; passes of more than {g['attention_fused_above']} tokens: ONNX Runtime's fused attention"
                if g.get("attention_fused_above") else "")
        return [f"  attention keys at their positions in float32 ({g[key]} nodes): rows independent of pass size{wide}"]
    if key == "fused_ops":
        return ["  fused ops " + ", ".join(f"{op} x{n}" for op, n in g["fused_ops"].items())
                + " (the capture line below says how many sites each could cover)"]
    if key == "fallback":
        f = g["fallback"]
        return [f"  fallback  {f['tensorrt_engines']} TensorRT engines, {f['torch_fallback_nodes']} nodes left to torch"
                + (f" ({', '.join(f['torch_fallback_ops'])})" if f["torch_fallback_ops"] else "")]
    return [f"  numerics  {g['numerics']}"]


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # an absent or broken optional package is what doctor reports
        return None


def _kernels_line() -> str:
    """doctor's line on specc's own int4 kernels (target.quantize: int4-gemm)."""
    from .. import kernels

    try:
        return (f"specc kernels (int4-gemm): {kernels.active_isa()} runs here; this CPU has "
                f"{', '.join(kernels.supported_isas())}")
    except SpeccError as exc:
        return f"specc kernels (int4-gemm): unavailable: {exc}"


def doctor_report() -> str:
    import torch

    from ..backends import get_backend, names
    from ..hardware import cpu, describe

    lines = [f"python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}",
             *describe(cpu()), _kernels_line()]
    cuda = torch.cuda.is_available()
    lines.append("cuda: " + (torch.cuda.get_device_name(0) + ' (sm_%d%d)' % torch.cuda.get_device_capability(0)
                             if cuda else 'no CUDA device'))
    rows = []
    for name in names():
        ok, detail = get_backend(name, check=False).availability()
        rows.append([name, "yes" if ok else "no", detail])
    lines.append(table(["backend", "available", "detail"], rows, "lll"))
    for mod in ("transformers", "onnx", "onnxruntime", "onnxscript", "tensorrt", "torch_tensorrt", "tritonclient"):
        lines.append(f"{mod:<16} {_version(mod) or 'not installed'}")
    return "\n".join(lines)
