"""The `specc` command line. User errors print one message and exit with code 2."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import ModelError, SpeccError, escape_control


def _recipe_help() -> str:
    from ..recipe import describe_schema

    return "recipe fields (YAML; see recipes/README.md and recipes/quickstart.yaml):\n" + "\n".join(describe_schema())


def cmd_compile(args) -> int:
    from ..compiler import compile_recipe
    from ..recipe import load_recipe

    from ..bundle import read_manifest

    recipe = load_recipe(args.recipe)
    path = compile_recipe(recipe, output=args.output, dump_graphs=args.dump_graphs, progress=not args.quiet)
    print(f"bundle written to {path}\nbundle id {read_manifest(path).id} (pin it with --expect-id)")
    return 0


def _load(args):
    from ..runtime.model import load

    return load(args.bundle, verify=not getattr(args, "no_verify", False), expect_id=args.expect_id,
                trust_code=args.trust_code)


def _check_output_file(path: Path | None, flag: str = "--json") -> None:
    """Refuse, before a long run, a file the run could not write at its end (folders are created)."""
    if path is None:
        return
    if path.is_dir():
        raise SpeccError(f"{flag} {path}: a directory; allowed a file path (its folders are created)")
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise SpeccError(f"{flag} {path}: {folder} is {'not a folder' if not folder.is_dir() else 'not writable'}; "
                         "allowed a file path under a folder you can write")


def _read_prompts(args) -> list[dict]:
    from ..bench.run import read_prompts

    prompts = [{"prompt": p, "chat": args.chat, "kind": ""} for p in (args.prompt or [])]
    if args.prompts:
        prompts += read_prompts(args.prompts, default_chat=args.chat)
    if not prompts:
        raise SpeccError("give at least one --prompt TEXT or --prompts FILE")
    return prompts


def _sampling_kwargs(args) -> dict:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }


def cmd_generate(args) -> int:
    from ..runtime.model import read_chat_template
    from ..runtime.stats import RunStats
    from .format import format_run_stats

    items = _read_prompts(args)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    model = _load(args)
    if template is not None:
        model.set_chat_template(template, f"--chat-template {args.chat_template}")
    kwargs = dict(_sampling_kwargs(args), stop=args.stop or (), speculative=not args.no_speculation, k=args.k)
    texts: dict[int, str] = {}
    run = RunStats()  # every group's figures (chat and plain prompts run as two calls)
    for chat in sorted({it["chat"] for it in items}):
        idx = [i for i, it in enumerate(items) if it["chat"] == chat]
        group = RunStats()
        if args.stream:
            for ev in model.stream([items[i]["prompt"] for i in idx], chat=chat, run_stats=group, **kwargs):
                if len(items) == 1:
                    print(ev.text, end="", flush=True)
                texts[idx[ev.index]] = texts.get(idx[ev.index], "") + ev.text
            if len(items) == 1:
                print()
        else:
            result = model.generate([items[i]["prompt"] for i in idx], chat=chat, **kwargs)
            for c in result:
                texts[idx[c.index]] = c.text
            group = result.stats
        run.merge(group)
    stats = run.to_dict()
    if args.json:
        print(json.dumps({"bundle_id": model.bundle.id, "completions": [texts[i] for i in range(len(items))],
                          "stats": stats}, indent=2))
        return 0
    if not (args.stream and len(items) == 1):
        for i in range(len(items)):
            print(f"--- [{i}] {items[i]['prompt'][:60]!r}\n{texts[i]}")
    speculative = not args.no_speculation and model.can_speculate
    print(format_run_stats(stats, speculative, lookup_first=speculative and model.lookup_first), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from ..bench.run import load_bundles, run_bench
    from ..speculation.tree import TreeShape

    if args.expect_id and len(args.bundle) != 1:
        raise SpeccError(f"--expect-id pins one bundle; bench was given {len(args.bundle)}")
    _check_output_file(args.json)
    if args.max_new_tokens < 1:
        raise SpeccError(f"--max-new-tokens {args.max_new_tokens}: allowed an integer >= 1")
    models = load_bundles(args.bundle, verify=not args.no_verify, trust_code=args.trust_code, expect_id=args.expect_id)
    try:
        trees = [TreeShape.parse(t) for t in args.tree or []]
    except ValueError as exc:
        raise SpeccError(f"--tree: {exc}") from None
    run_bench(models, _read_prompts(args), max_new_tokens=args.max_new_tokens, k_values=args.k or [], trees=trees,
              repeats=args.repeats, json_path=args.json, batch_size=args.batch_size, seed=args.seed, compare=args.compare,
              llamacpp={"target_gguf": args.llamacpp_target, "draft_gguf": args.llamacpp_draft, "threads": args.threads},
              stop_below=args.stop_below or [])
    return 0


def cmd_eval(args) -> int:
    from ..bench.quality import evaluate, format_eval, text_chunks
    from ..bench.run import encode_prompts
    from ..bench.tune import write_json

    _check_output_file(args.json)
    model = _load(args)
    texts = text_chunks(model, args.text, args.chunk_tokens) if args.text else []
    if args.prompt or args.prompts:
        texts += [ids for ids in encode_prompts(model, _read_prompts(args)) if len(ids) >= 2]
    if not texts:
        raise SpeccError("give --text FILE (plain text, cut into --chunk-tokens pieces) or --prompt/--prompts")
    results = evaluate(model, texts, gguf=args.gguf, threads=args.threads)
    print(format_eval(results))
    if args.json:
        write_json(results, args.json)
        print(f"written: {args.json}")
    return 0


def cmd_tune(args) -> int:
    from ..bench.tune import check_recipe_matches, format_tune, run_tune, set_recipe_fields, write_json

    if args.write and not args.recipe:
        raise SpeccError("--write needs --recipe RECIPE.yaml (the recipe the bundle was compiled from)")
    _check_output_file(args.json)
    model = _load(args)
    if args.recipe:
        check_recipe_matches(args.recipe, model)
    result = run_tune(model, _read_prompts(args), k_max=args.k_max, max_new_tokens=args.max_new_tokens,
                      repeats=args.repeats, timing_prompts=args.timing_prompts, check_k=args.check_k,
                      stop_below=args.stop_below or [], progress=not args.quiet)
    print(format_tune(result))
    fields = {("speculation", "k"): result["best_k"]}
    if result["best_stop_below"] is not None:
        fields[("draft", "stop_below")] = result["best_stop_below"]
    settings = ", ".join(f"{section}.{key}: {value}" for (section, key), value in fields.items())
    if args.write:
        old = set_recipe_fields(args.recipe, fields)
        result["recipe_written"] = {"path": str(args.recipe),
                                    **{f"{s}.{k}": [old[s, k], v] for (s, k), v in fields.items()}}
        changes = ", ".join(f"{s}.{k} {old[s, k]} -> {v}" for (s, k), v in fields.items())
        print(f"{args.recipe}: {changes} (recompile with `specc compile {args.recipe}` for the bundle to use it; "
              f"`specc generate --k {result['best_k']}` uses the k now)")
    elif args.recipe:
        print(f"run again with --write to set {settings} in {args.recipe}")
    if args.json:
        write_json(result, args.json)
        print(f"written: {args.json}")
    return 0


def cmd_inspect(args) -> int:
    from ..bundle import open_bundle
    from .format import format_manifest, terminal_safe

    bundle = open_bundle(args.bundle, verify=not args.no_verify, expect_id=args.expect_id)
    if args.json:
        print(json.dumps({"id": bundle.id, "manifest": bundle.manifest.raw}, indent=2))
    else:
        print(terminal_safe(format_manifest(bundle.manifest, bundle.path, verified=not args.no_verify)))
    return 0


def cmd_triton(args) -> int:
    from ..triton import write_repository

    plans = write_repository(args.bundle, args.repo, name=args.name, layout=args.layout, engines=args.engines,
                             force=args.force, default_max_tokens=args.default_max_tokens, expect_id=args.expect_id,
                             trust_code=args.trust_code)
    print(f"Triton model repository written to {args.repo} (layout {args.layout}):")
    for plan in plans:
        print(f"  {plan.name:<24} {plan.summary}")
    print(f"serve it with `tritonserver --model-repository {args.repo}` (the server's Python environment needs specc); "
          f"clients call model {plans[0].name!r}, see docs/triton.md")
    return 0


def cmd_serve(args) -> int:
    from ..serving import serve

    serve(args.bundle, host=args.host, port=args.port, name=args.name, api_key=args.api_key,
          k=args.k, speculative=not args.no_speculation, max_batch=args.max_batch,
          max_queue=args.max_queue, verify=not args.no_verify, expect_id=args.expect_id, trust_code=args.trust_code,
          chat_template=args.chat_template, shutdown_timeout=args.shutdown_timeout, max_body_mb=args.max_body_mb)
    return 0


def _prompt_set(text: str) -> tuple[int, str]:
    """--prompts: N, or N:self."""
    count, _, chat = text.partition(":")
    try:
        return int(count), chat or "grid"
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N:self (N prompts), got {text!r}") from None


def _k_value(text: str) -> int | str:
    """--k: an integer, or 'auto' (adaptive speculation)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', got {text!r}") from None


def cmd_doctor(args) -> int:
    from .format import doctor_report

    print(doctor_report())
    return 0


def cmd_trt_check(args) -> int:
    from ..backends.trt_coverage import check_onnx, format_report

    if not args.onnx.is_file():
        raise SpeccError(f"{args.onnx} does not exist or is not a file")
    report = check_onnx(args.onnx)
    print(format_report(report))
    return 0 if report.ok else 1


def cmd_passes(args) -> int:
    from ..passes import describe_passes

    print(describe_passes())
    return 0


def cmd_models(args) -> int:
    from ..models import catalog

    if args.action == "check":
        from ..capture.check import check_model, describe

        report = check_model(args.model)
        if report.family is None:
            raise ModelError(describe(args.model, report))
        print(describe(args.model, report))
        return 0
    if args.action == "list" and args.families:
        from ..capture.check import families_table

        print(families_table())
        return 0
    if args.action == "list":
        for m in catalog.CATALOG.values():
            print(f"{m.name:<30} {catalog.status(m.name):<16} {m.description}")
        return 0
    path = catalog.pull(args.name)
    print(f"{args.name}: {path}")
    return 0


def cmd_train_head(args) -> int:
    from ..hardware import cpu
    from ..models.cache import cache_dir
    from ..models.load import load_model
    from ..recipe import load_recipe
    from ..training.heads import TrainConfig, check_train_config, consecutive_sets, train_head

    recipe = load_recipe(args.recipe)
    cfg = TrainConfig(kind=args.kind, steps=args.steps, lr=args.lr, heads=args.heads, batch_seqs=args.batch_seqs,
                      draft_vocab=args.draft_vocab or None, eval_every=args.eval_every, unroll=args.unroll,
                      dtype=args.dtype, init=args.init)
    data_cfgs = consecutive_sets(args.prompts or [192], new_tokens=args.new_tokens, source=args.source, dtype=args.dtype)
    output = args.output or Path("heads") / f"{Path(recipe.target.model).name}-{args.kind}"
    check_train_config(cfg, data_cfgs, output)
    if args.dtype == "bfloat16" and not cpu()["native_bfloat16"]:
        print("specc: warning: this CPU has no native bfloat16 matmul (AVX512-BF16 or AMX; `specc doctor`): "
              "--dtype bfloat16 is emulated here and slower than float32", file=sys.stderr)
    loaded = load_model(recipe.target.model)
    _, card = train_head(loaded.model, loaded.tokenizer, recipe.target.model, cfg, data_cfgs, output, cache_dir("heads"))
    acc = card["held_out"]["greedy_acceptance_by_position"]
    print(f"{args.kind} head for {recipe.target.model}: {card['data']['tokens']} tokens, {card['steps']} steps, "
          f"{card['train_seconds']:.0f} s training")
    print("held-out greedy acceptance by position: " + ", ".join(f"{a:.2f}" for a in acc)
          + f" (expected {card['held_out']['expected_accepted_per_round']:.2f} drafts accepted per round)")
    rounds = card["held_out"]["round_acceptance_by_position_k3"]
    print("in greedy chain rounds of 3 drafts over the held-out answers, as a run counts it: "
          + ", ".join(f"{a:.2f}" for a in rounds) + f" ({card['held_out']['tokens_per_target_pass_k3']:.2f} tokens per target pass)")
    method = "eagle" if args.kind == "eagle3" else args.kind
    print(f"head: {output} (config.json, model.safetensors, card.json); use it with draft.method: {method}, "
          f"draft.head: {output}")
    return 0


def cmd_train_exit_head(args) -> int:
    from ..heads.exit import save_adapter
    from ..models.load import load_model
    from .format import table
    from ..training.exit_head import TrainConfig, train_exit_head

    loaded = load_model(args.model)
    cfg = TrainConfig(layer=args.layer, corpus=args.corpus, train_tokens=args.train_tokens, eval_tokens=args.eval_tokens,
                      seq_len=args.seq_len, rank=args.rank, steps=args.steps, lr=args.lr)
    adapter, report = train_exit_head(loaded.model, loaded.tokenizer, cfg)
    report["model"] = args.model
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_adapter(args.output, adapter, args.layer, report)
    args.output.with_suffix(".json").write_text(json.dumps(report, indent=2))
    rows = [[name, report[key]["greedy_top1_agreement"], report[key]["expected_sampling_acceptance"]]
            for name, key in (("exit head alone", "without_adapter"), ("with trained adapter", "with_adapter"))]
    print(f"layer {args.layer} of {report['layers']}, {report['with_adapter']['tokens']} held-out tokens")
    print(table(["early exit", "greedy top-1 agreement", "expected sampling acceptance"], rows))
    print(f"adapter written to {args.output} (report: {args.output.with_suffix('.json')})")
    return 0


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the recipe's)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)


def _add_prompts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts", type=Path, help="file: JSON lines {\"prompt\": ..., \"chat\": bool} or one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to plain prompts")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle's files "
                   "(sizes and the file listing are still checked)")
    _add_trust(p)


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expect-id", metavar="ID", help="refuse the bundle unless its id (`specc inspect`) is ID")
    p.add_argument("--trust-code", action="store_true", help="allow backends that run code from the bundle "
                   "(aoti shared objects, torch_tensorrt pickles); see docs/security.md")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specc", description="Compile and run speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specc {__import__('specc').__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="build a bundle from a recipe", epilog=_recipe_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", type=Path)
    p.add_argument("-o", "--output", type=Path, help="bundle directory (default: the recipe's output)")
    p.add_argument("--dump-graphs", type=Path, help="write each graph's summary and code after the passes here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("generate", help="generate text with a bundle")
    p.add_argument("bundle", type=Path)
    _add_prompts(p)
    _add_sampling(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted")
    p.add_argument("--no-speculation", action="store_true", help="target only, on the same compiled target")
    p.add_argument("--k", type=_k_value, default=None,
                   help="draft tokens per round, or auto: chosen each round from measured acceptance and costs "
                        "(default: the recipe's)")
    p.add_argument("--json", action="store_true", help="print completions and stats as JSON")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="Jinja chat template for --chat prompts, instead of the tokenizer's (or where it has none)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API (docs/serving.md)",
                       description="OpenAI-compatible server: /v1/completions, /v1/chat/completions (streaming or "
                                   "not), /v1/models, /health, /metrics (Prometheus). Requests join the running batch "
                                   "between rounds; speculation adapts k to the load (--k auto). Needs the serve extra.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", help="the model name clients send (default: the bundle directory's name)")
    p.add_argument("--api-key", default=os.environ.get("SPECC_API_KEY"),
                   help="require the header Authorization: Bearer API_KEY on every route but /health and /metrics "
                        "(default: $SPECC_API_KEY, "
                        "which keeps the key out of the process list)")
    p.add_argument("--max-batch", type=int, default=None, help="most rows per round (default: the bundle's limits.max_batch)")
    p.add_argument("--max-queue", type=int, default=256, help="most sequences waiting for a row; more answer 429, "
                   "and a request of more sequences than this 400")
    p.add_argument("--k", type=_k_value, default="auto", help="draft tokens per round, or auto (default)")
    p.add_argument("--no-speculation", action="store_true", help="serve the target alone (the baseline)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle's files")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions, instead of the tokenizer's (or where it has none)")
    p.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, stop taking requests and give those in flight up to S seconds to "
                        "finish; the rest end with an error (default 20; a second signal stops at once)")
    p.add_argument("--max-body-mb", type=float, default=8.0, metavar="MB",
                   help="largest request body in MiB; larger ones answer 413 before they are read (default 8)")
    _add_trust(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="speculative vs target-only (and Hugging Face) on the same prompts, in one run",
                       description="Every system runs the same prompt token ids, greedy, same max_new_tokens; systems "
                                   "alternate within each repeat and the median repeat is reported; every output is "
                                   "compared token for token with the reference. docs/benchmarks.md explains the method.")
    p.add_argument("bundle", type=Path, nargs="+", help="one or more bundles of the same target (the first gives the baseline)")
    _add_prompts(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=_k_value, action="append",
                   help="chain speculation length to measure, or auto (adaptive k; repeatable)")
    p.add_argument("--tree", action="append", help="token tree DEPTH,BRANCHING,MAX_NODES[,VERIFY_NODES] to measure on tree bundles (repeatable; VERIFY_NODES: EAGLE-2 rerank)")
    p.add_argument("--stop-below", type=float, action="append", metavar="P",
                   help="measure each chain of a draft model or EAGLE head at this draft.stop_below instead of the "
                        "recipe's: a row's chain ends after a draft below probability P (repeatable; 0: never)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system, alternated; the median is reported")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    p.add_argument("--compare", choices=["hf", "llamacpp"], help="hf: also run Hugging Face transformers on the same weights: "
                   "generate (the reference), assisted generation with the bundle's draft model (default schedule and each k), "
                   "prompt lookup (each k); llamacpp: llama.cpp (llama-cpp-python) on the target's GGUF, target-only and "
                   "speculative with the draft's GGUF (its default draft length and each k); batch 1")
    p.add_argument("--llamacpp-target", type=Path, help="--compare llamacpp: target GGUF (default: the GGUF the bundle's "
                   "target came from)")
    p.add_argument("--llamacpp-draft", type=Path, help="--compare llamacpp: draft GGUF (default: the GGUF of a bundle's draft "
                   "model; none: prompt lookup)")
    p.add_argument("--threads", type=int, help="--compare llamacpp: llama.cpp threads (default: the CPUs this process may use, "
                   "as ONNX Runtime)")
    p.add_argument("--json", type=Path, help="write the results here, with a Markdown report (.md) and a plot (.png) beside it")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="quality of a (quantised) target: top-1 agreement with float32 and perplexity",
                       description="Teacher-forced passes over a fixed text set through the float32 target (transformers), "
                                   "the bundle's compiled target and optionally llama.cpp on a GGUF; reports how often each "
                                   "system's most likely next token equals the float32 target's, and each one's perplexity.")
    p.add_argument("bundle", type=Path)
    _add_prompts(p)
    p.add_argument("--text", type=Path, help="plain text file, cut into pieces of --chunk-tokens tokens")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--gguf", type=Path, help="also evaluate llama.cpp on this GGUF (the llamacpp extra)")
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: the CPUs this process may use)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("tune", help="measure draft, verify and decode costs and acceptance; pick speculation.k",
                       description="Predicts the speed-up of each chain length k from measured costs and acceptance, "
                                   "S(k) = E(k) / (k c_d/c_t + c_v(k)/c_t), E(k) = 1 + s_1 + ... + s_k with s_i the measured "
                                   "fraction of rounds whose first i drafts are accepted (prompt lookup, alone or in front "
                                   "of a model, priced by its hit rate), picks the best k and "
                                   "measures speculative vs target-only at a few k beside the prediction. "
                                   "docs/benchmarks.md explains the method.")
    p.add_argument("bundle", type=Path)
    _add_prompts(p)
    p.add_argument("--k-max", type=int, default=8, help="largest k to consider (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs of each measured check, alternated; the median is reported")
    p.add_argument("--timing-prompts", type=int, default=4, help="prompts whose KV cache the engine calls are timed on")
    p.add_argument("--check-k", type=int, action="append",
                   help="k to measure beside the prediction (repeatable; default: 1, best-1, best, best+1, the recipe's)")
    p.add_argument("--stop-below", type=float, action="append", metavar="P",
                   help="also measure the best k with chains ending after a draft below probability P (repeatable; "
                        "drafters of one token at a time); --write then sets the fastest as draft.stop_below")
    p.add_argument("--recipe", type=Path, help="the recipe the bundle was compiled from (checked against the bundle)")
    p.add_argument("--write", action="store_true",
                   help="set speculation.k in --recipe to the best k (and draft.stop_below with --stop-below; comments kept)")
    p.add_argument("--json", type=Path, help="write the measurements and predictions here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("inspect", help="show a bundle's manifest")
    p.add_argument("bundle", type=Path)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check (sizes and listing are still checked)")
    p.add_argument("--expect-id", metavar="ID", help="refuse the bundle unless its id is ID")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("triton", help="write a Triton Inference Server model repository that serves a bundle",
                       description="Write a Triton model repository: the speculative orchestrator as a python-backend "
                                   "model in decoupled mode (streams tokens as rounds accept them). docs/triton.md "
                                   "compares the layouts and lists the model's inputs and outputs.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--repo", type=Path, required=True, help="the model repository directory to write")
    p.add_argument("--name", help="the model clients call (default: the bundle directory's name)")
    p.add_argument("--layout", choices=["in-process", "split"], default="in-process",
                   help="in-process: one python model runs the whole bundle (every backend); split: target and draft "
                        "are separate Triton models the orchestrator calls with BLS")
    p.add_argument("--engines", choices=["native", "python"], default="native",
                   help="split layout: serve the graphs with Triton's onnxruntime_onnx / tensorrt_plan platform "
                        "(native), or with python-backend models running the bundle's backend")
    p.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens of requests that do not set it")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty repository (replaces model directories of the same names)")
    _add_trust(p)
    p.set_defaults(func=cmd_triton)

    p = sub.add_parser("doctor", help="which backends, devices and versions this machine has")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("trt-check", help="check an ONNX file against TensorRT's supported operators (no TensorRT needed)")
    p.add_argument("onnx", type=Path)
    p.set_defaults(func=cmd_trt_check)

    p = sub.add_parser("passes", help="list the graph passes with their contracts")
    p.set_defaults(func=cmd_passes)

    p = sub.add_parser("train-head", help="train a Medusa or EAGLE draft head on the recipe's target (CPU, self-distillation)")
    p.add_argument("recipe", type=Path, help="recipe whose target.model the head drafts for")
    p.add_argument("--kind", required=True, choices=("medusa", "eagle", "eagle3"),
                   help="eagle: EAGLE-1/2 (last-layer feature); eagle3: EAGLE-3 (low, middle and high layers fused); "
                        "both run as draft.method eagle")
    p.add_argument("--prompts", type=_prompt_set, action="append", metavar="N[:self]",
                   help="offline prompts the target answers (half code, half chat; default 192); repeat it to add sets "
                        "of further prompts to a head's data (each set cached on its own, so adding one to a trained "
                        "head's command answers only the new prompts and resumes training); N:self: the set's chat "
                        "prompts are user messages the target writes itself (sampled) instead of templated ones")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens the target writes per answer")
    p.add_argument("--source", choices=("answers", "text"), default="answers",
                   help="answers: the target answers offline prompts (best, one target step per token); text: "
                        "teacher-forced windows of standard-library source (--prompts windows of 256 tokens; cheap)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-seqs", type=int, default=4, help="sequences per training step")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-3 for targets up to 1024 wide, 3e-4 above)")
    p.add_argument("--heads", type=int, default=4, help="medusa: number of heads")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (0: the full vocabulary)")
    p.add_argument("--unroll", type=int, default=3,
                   help="eagle: draft steps trained per position, fed the head's own features (1: teacher forcing only)")
    p.add_argument("--init", choices=("random", "target"), default="random",
                   help="eagle, eagle3: target starts the head's decoder layer as the target's last layer (attention, "
                        "MLP) with fc passing the feature (eagle3: the highest fused layer) through; random: a fresh layer")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out acceptance estimates")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's passes and the training matmuls; bfloat16 is several times faster on CPUs with "
                        "AMX (Sapphire Rapids and later) and slower on others; the head's weights stay float32")
    p.add_argument("-o", "--output", type=Path, help="head directory (default heads/<target>-<kind>); rerunning resumes")
    p.set_defaults(func=cmd_train_head)

    p = sub.add_parser("train-exit-head", help="train an early-exit adapter on a local text corpus (CPU)")
    p.add_argument("model", help="catalog name, Hugging Face directory or .gguf file (the target)")
    p.add_argument("--layer", type=int, required=True, help="exit after this many layers (draft.layer)")
    p.add_argument("--corpus", type=Path, help="directory of text files (default: the Python standard library)")
    p.add_argument("--train-tokens", type=int, default=60_000)
    p.add_argument("--eval-tokens", type=int, default=6_000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rank", type=int, default=None, help="adapter width (default: the hidden size)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("-o", "--output", type=Path, required=True, help="adapter file (.safetensors); a .json report goes beside it")
    p.set_defaults(func=cmd_train_exit_head)

    p = sub.add_parser("models", help="the offline model catalog")
    msub = p.add_subparsers(dest="action", required=True)
    lst = msub.add_parser("list", help="catalog models and whether they are pulled")
    lst.add_argument("--families", action="store_true", help="the model families specc compiles (markdown table)")
    check = msub.add_parser("check", help="would this model compile? which family, or what is missing (reads config.json only)")
    check.add_argument("model", help="catalog name, Hugging Face model directory or config.json")
    pull = msub.add_parser("pull", help="download, assemble, verify and convert a catalog model")
    pull.add_argument("name")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpeccError as exc:
        from .format import terminal_safe

        print(f"specc: error: {terminal_safe(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (`| head`): nothing left to say
        sys.stderr.close()
        return 0
    except OSError as exc:  # a path the user gave that cannot be read or written
        where = f"{escape_control(exc.filename)}: " if exc.filename else ""
        from .format import terminal_safe

        print(f"specc: error: {terminal_safe(f'{where}{exc.strerror or exc}')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
