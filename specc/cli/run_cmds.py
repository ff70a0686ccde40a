"""Subcommands that run a bundle on prompts: generate, bench, eval, tune.

Each command checks its inputs before it imports what loads models (torch), so a wrong invocation
answers at once."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..errors import SpeccError
from . import checks
from .parser import (add_context_settings, add_json, add_prompts, add_sampling, add_seed, add_warm,
                     apply_context_settings, deprecated_alias, json_file, json_to_stdout, k_value)


def load_model(args: argparse.Namespace):
    from ..runtime.model import load

    return load(args.bundle, verify=not getattr(args, "no_verify", False), expect_id=args.expect_id,
                trust_code=args.trust_code)


def read_prompts(args: argparse.Namespace, required: bool = True) -> list[dict]:
    """--prompt and --prompts items; read before any bundle loads, so a bad file fails at once."""
    from ..bench.run import read_prompts as read_file

    prompts = [{"prompt": p, "chat": args.chat, "kind": ""} for p in (args.prompt or [])]
    if args.prompts:
        prompts += read_file(args.prompts, default_chat=args.chat, per_kind=getattr(args, "per_kind", None))
    if required and not prompts:
        raise SpeccError("give at least one --prompt TEXT or --prompts FILE")
    return prompts


def write_json(args: argparse.Namespace, result: dict) -> None:
    """The result on stdout (--json) or in a file (--json FILE)."""
    if json_to_stdout(args):
        print(json.dumps(result, indent=2))
    elif path := json_file(args):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"written: {path}")


def human_output(args: argparse.Namespace):
    """Where tables and messages go: stderr when stdout carries the JSON."""
    return contextlib.redirect_stdout(sys.stderr) if json_to_stdout(args) else contextlib.nullcontext()


def check_run_inputs(args: argparse.Namespace) -> None:
    """The checks generate, bench, eval and tune share: bundle directories, --json FILE, --max-new-tokens
    (and --prefix-cache-mb, --prefill-chunk where the command has them)."""
    for bundle in args.bundle if isinstance(args.bundle, list) else [args.bundle]:
        checks.bundle_dir(bundle)
    checks.output_file(json_file(args))
    checks.at_least(getattr(args, "max_new_tokens", None), "--max-new-tokens")
    checks.at_least(getattr(args, "prefix_cache_mb", None), "--prefix-cache-mb", low=0)
    checks.at_least(getattr(args, "prefill_chunk", None), "--prefill-chunk")


def read_rules(args: argparse.Namespace) -> dict:
    """--json-schema, the penalties and --logprobs as `generate` arguments, checked before anything loads."""
    schema = None
    if args.json_schema is not None:
        checks.input_file(args.json_schema, "--json-schema")
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise SpeccError(f"--json-schema {args.json_schema}: not a JSON file ({exc})") from None
        if not isinstance(schema, dict):
            raise SpeccError(f"--json-schema {args.json_schema}: allowed a JSON schema object, got {type(schema).__name__}")
    for flag, value, low, high in (("--presence-penalty", args.presence_penalty, -2, 2),
                                   ("--frequency-penalty", args.frequency_penalty, -2, 2)):
        if not low <= value <= high:
            raise SpeccError(f"{flag} {value}: allowed a number in [{low}, {high}]")
    from ..runtime.rules import MAX_REPETITION_PENALTY as HIGH, MIN_REPETITION_PENALTY as LOW

    if not LOW <= args.repetition_penalty <= HIGH:
        raise SpeccError(f"--repetition-penalty {args.repetition_penalty}: allowed a number in [{LOW:g}, {HIGH:g}] (1 = off)")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise SpeccError(f"--logprobs {args.logprobs}: allowed an integer in [0, 20]")
    return dict(json_schema=schema, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)


def cmd_generate(args: argparse.Namespace) -> int:
    check_run_inputs(args)
    checks.input_file(args.chat_template, "--chat-template")
    items = read_prompts(args)
    rules = read_rules(args)
    warm_texts = checks.warm_file(args.warm)
    from ..runtime.model import read_chat_template, warm_from
    from ..runtime.stats import RunStats
    from .format import format_run_stats

    template = read_chat_template(args.chat_template) if args.chat_template else None
    model = load_model(args)
    warm_from(model, warm_texts, log=lambda m: print(m, file=sys.stderr))
    apply_context_settings(model, args)
    if template is not None:
        model.set_chat_template(template, f"--chat-template {args.chat_template}")
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, stop=args.stop or (), speculative=not args.no_speculation, k=args.k, **rules)
    logprobs: dict[int, list] = {}
    texts: dict[int, str] = {}
    run = RunStats()  # every group's figures (chat and plain prompts run as two calls)
    echo = args.stream and len(items) == 1 and not json_to_stdout(args)
    for chat in sorted({it["chat"] for it in items}):
        idx = [i for i, it in enumerate(items) if it["chat"] == chat]
        group = RunStats()
        if args.stream:
            for ev in model.stream([items[i]["prompt"] for i in idx], chat=chat, run_stats=group, **kwargs):
                if echo:
                    print(ev.text, end="", flush=True)
                texts[idx[ev.index]] = texts.get(idx[ev.index], "") + ev.text
            if echo:
                print()
        else:
            result = model.generate([items[i]["prompt"] for i in idx], chat=chat, **kwargs)
            for c in result:
                texts[idx[c.index]] = c.text
                logprobs[idx[c.index]] = c.logprobs
            group = result.stats
        run.merge(group)
    stats = run.to_dict()
    result = {"bundle_id": model.bundle.id, "completions": [texts[i] for i in range(len(items))], "stats": stats}
    if args.logprobs is not None and not args.stream:
        result["logprobs"] = [[{"token": t, "logprob": lp, "top": alts} for t, lp, alts in logprobs[i] or []]
                              for i in range(len(items))]
    if json_to_stdout(args):
        write_json(args, result)
        return 0
    if not echo:
        for i in range(len(items)):
            print(f"--- [{i}] {items[i]['prompt'][:60]!r}\n{texts[i]}")
    speculative = not args.no_speculation and model.can_speculate
    print(format_run_stats(stats, speculative, front=model.front_drafter if speculative else None), file=sys.stderr)
    write_json(args, result)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.llamacpp_server import parse_server
    from ..bench.run import check_bench_settings, load_bundles, run_bench

    if args.expect_id and len(args.bundle) != 1:
        raise SpeccError(f"--expect-id pins one bundle; bench was given {len(args.bundle)}")
    check_run_inputs(args)
    check_bench_settings(args.repeats, args.max_batch, args.stop_below or [], args.compare)
    if args.llamacpp_server and args.max_batch != 1:
        raise SpeccError("--llamacpp-server measures batch 1 (one request at a time); drop --max-batch")
    for spec in args.llamacpp_server or []:
        parse_server(spec)
    if args.per_kind is not None and args.per_kind < 1:
        raise SpeccError(f"--per-kind must be at least 1, got {args.per_kind}")
    if args.compare == "llamacpp":
        checks.llamacpp_installed("--compare llamacpp")
    checks.input_file(args.llamacpp_target, "--llamacpp-target")
    checks.input_file(args.llamacpp_draft, "--llamacpp-draft")
    items = read_prompts(args)
    texts = checks.warm_file(args.warm)
    trees = parse_trees(args.tree) if args.tree else []
    with human_output(args):
        from ..runtime.model import warm_from

        models = load_bundles(args.bundle, verify=not args.no_verify, trust_code=args.trust_code, expect_id=args.expect_id)
        for model in models:
            warm_from(model, texts)
            apply_context_settings(model, args)
        results = run_bench(models, items, max_new_tokens=args.max_new_tokens, k_values=args.k or [], trees=trees,
                            repeats=args.repeats, json_path=json_file(args), batch_size=args.max_batch, seed=args.seed,
                            compare=args.compare, llamacpp={"target_gguf": args.llamacpp_target,
                                                            "draft_gguf": args.llamacpp_draft, "threads": args.threads},
                            stop_below=args.stop_below or [], llamacpp_servers=args.llamacpp_server or [])
    if json_to_stdout(args):
        write_json(args, results)
    return 0


def parse_trees(specs: list[str]) -> list:
    """--tree values as TreeShapes (imported only when asked for: it brings torch)."""
    from ..speculation.tree import TreeShape

    try:
        return [TreeShape.parse(t) for t in specs]
    except ValueError as exc:
        raise SpeccError(f"--tree: {exc}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    check_run_inputs(args)
    checks.input_file(args.text, "--text")
    checks.input_file(args.gguf, "--gguf")
    checks.at_least(args.chunk_tokens, "--chunk-tokens", 2)
    if args.gguf:
        checks.llamacpp_installed("--gguf")
    items = read_prompts(args, required=False)
    if not (args.text or items):
        raise SpeccError("give --text FILE (plain text, cut into --chunk-tokens pieces) or --prompt/--prompts")
    from ..bench.quality import evaluate, format_eval, text_chunks
    from ..bench.run import encode_prompts

    with human_output(args):
        model = load_model(args)
        texts = text_chunks(model, args.text, args.chunk_tokens) if args.text else []
        texts += [ids for ids in encode_prompts(model, items) if len(ids) >= 2]
        if not texts:
            raise SpeccError("every prompt is a single token; eval needs texts of at least 2 tokens")
        results = evaluate(model, texts, gguf=args.gguf, threads=args.threads)
        print(format_eval(results))
    write_json(args, results)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    if args.write and not args.recipe:
        raise SpeccError("--write needs --recipe RECIPE.yaml (the recipe the bundle was compiled from)")
    check_run_inputs(args)
    checks.input_file(args.recipe, "--recipe")
    for value, flag in ((args.k_max, "--k-max"), (args.repeats, "--repeats"), (args.timing_prompts, "--timing-prompts")):
        checks.at_least(value, flag)
    items = read_prompts(args)
    from ..bench.tune import check_recipe_matches, format_tune, run_tune
    from ..recipe_edit import set_recipe_fields

    with human_output(args):
        model = load_model(args)
        if args.recipe:
            check_recipe_matches(args.recipe, model)
        result = run_tune(model, items, k_max=args.k_max, max_new_tokens=args.max_new_tokens,
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
    write_json(args, result)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:  # long: one flat table of options, read top to bottom
    """Register generate, bench, eval and tune."""
    p = sub.add_parser("generate", help="generate text with a bundle", description="Generate text with a bundle.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    add_prompts(p)
    add_sampling(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted")
    p.add_argument("--json-schema", type=Path, metavar="FILE",
                   help="constrain every output to the JSON schema in FILE (xgrammar; speculation stays exact)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logits of tokens already generated, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count so far from its logit, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive (multiply negative) logits of prompt and generated tokens by this; 1 = off")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's logprob and its N most likely alternatives (default: none)")
    p.add_argument("--no-speculation", action="store_true", help="target only, on the same compiled target")
    p.add_argument("--k", type=k_value, default=None,
                   help="draft tokens per round, or auto: chosen each round from measured acceptance and costs "
                        "(default: the recipe's)")
    add_warm(p)
    add_context_settings(p)
    add_json(p, "completions and stats")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="Jinja chat template for --chat prompts, instead of the tokenizer's (or where it has none)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="speculative vs target-only (and Hugging Face) on the same prompts, in one run",
                       description="Every system runs the same prompt token ids, greedy, same max_new_tokens; systems "
                                   "alternate within each repeat and the median repeat is reported; every output is "
                                   "compared token for token with the reference. docs/benchmarks.md explains the method.")
    p.add_argument("bundle", type=Path, nargs="+", help="one or more bundles of the same target (the first gives the baseline)")
    add_prompts(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
    add_seed(p)
    p.add_argument("--k", type=k_value, action="append",
                   help="chain speculation length to measure, or auto (adaptive k; repeatable; default: the recipe's)")
    p.add_argument("--tree", action="append", help="token tree DEPTH,BRANCHING,MAX_NODES[,VERIFY_NODES] to measure on "
                   "tree bundles (repeatable; VERIFY_NODES: EAGLE-2 rerank)")
    p.add_argument("--stop-below", type=float, action="append", metavar="P",
                   help="measure each chain of a draft model or EAGLE head at this draft.stop_below instead of the "
                        "recipe's: a row's chain ends after a draft below probability P (repeatable; 0: never)")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompts (the systems take turns prompt by prompt); the median pass is reported")
    p.add_argument("--per-kind", type=int, metavar="N", help="the first N prompts of each kind (a Spec-Bench category, "
                   "code, chat) of --prompts FILE: a sample per category (default: every prompt)")
    batch = p.add_argument("--max-batch", type=int, default=1, help="prompts per generate call (rows per round)")
    deprecated_alias(p, "--batch-size", batch)
    p.add_argument("--compare", choices=["hf", "llamacpp"], help="hf: also run Hugging Face transformers on the same weights: "
                   "generate (the reference), assisted generation with the bundle's draft model (default schedule and each k), "
                   "prompt lookup (each k); llamacpp: llama.cpp (the llamacpp extra) on the target's GGUF, "
                   "target-only and speculative with the draft's GGUF (its default draft length and each k); batch 1")
    p.add_argument("--llamacpp-target", type=Path, metavar="GGUF", help="--compare llamacpp: target GGUF (default: the "
                   "GGUF the bundle's target came from)")
    p.add_argument("--llamacpp-draft", type=Path, metavar="GGUF", help="--compare llamacpp: draft GGUF (default: the GGUF "
                   "of a bundle's draft model; without one, prompt lookup)")
    p.add_argument("--threads", type=int, help="--compare llamacpp: llama.cpp threads (default: the CPUs this process may "
                   "use, as ONNX Runtime)")
    p.add_argument("--llamacpp-server", action="append", metavar="[LABEL=]URL", help="also a running llama-server "
                   "(e.g. scripts/build_llamacpp.sh's, started with or without --spec-type): the same prompt ids through "
                   "its /completion, greedy; repeat for several servers (docs/benchmarks.md)")
    add_warm(p)
    add_context_settings(p, prefix_cache_default=0)  # repeats of the same prompts would hit the cache
    add_json(p, "the results (with FILE: a Markdown report (.md) and a plot (.png) beside it)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="quality of a (quantised) target: top-1 agreement with float32 and perplexity",
                       description="Teacher-forced passes over a fixed text set through the float32 target (transformers), "
                                   "the bundle's compiled target and optionally llama.cpp on a GGUF; reports how often each "
                                   "system's most likely next token equals the float32 target's, and each one's perplexity.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    add_prompts(p)
    p.add_argument("--text", type=Path, metavar="FILE", help="plain text file, cut into pieces of --chunk-tokens tokens")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per piece of --text")
    p.add_argument("--gguf", type=Path, help="also evaluate llama.cpp on this GGUF (the llamacpp extra)")
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: the CPUs this process may use)")
    add_json(p, "the results")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("tune", help="measure draft, verify and decode costs and acceptance; pick speculation.k",
                       description="Predicts the speed-up of each chain length k from measured costs and acceptance, "
                                   "S(k) = E(k) / (k c_d/c_t + c_v(k)/c_t), E(k) = 1 + s_1 + ... + s_k with s_i the measured "
                                   "fraction of rounds whose first i drafts are accepted (prompt lookup, alone or in front "
                                   "of a model, priced by its hit rate), picks the best k and "
                                   "measures speculative vs target-only at a few k beside the prediction. "
                                   "docs/benchmarks.md explains the method.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    add_prompts(p)
    p.add_argument("--k-max", type=int, default=8, help="largest k to consider")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
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
    add_json(p, "the measurements and predictions")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tune)
