"""Subcommands about models and draft heads: models (list, check, pull), train-head, train-exit-head.

Each command checks its inputs before it imports what loads models (torch), so a wrong invocation
answers at once."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ModelError
from . import checks
from .parser import deprecated_alias


def cmd_models(args: argparse.Namespace) -> int:
    from ..models import catalog

    if args.action == "check":
        from ..capture.check import check_config, describe, read_config

        config = read_config(args.model)
        report = check_config(config)
        if report.family is None:
            raise ModelError(describe(args.model, report))
        print(describe(args.model, report, config))
        return 0
    if args.action == "list" and args.families:
        from ..capture.check import families_table

        print(families_table())
        return 0
    if args.action == "list":
        for m in catalog.CATALOG.values():
            print(f"{m.name:<30} {catalog.status(m.name):<16} {m.description}\n{'':<30} source: {m.source}")
        return 0
    path = catalog.pull(args.name)
    print(f"{args.name}: {path}")
    return 0


def _prompt_set(text: str) -> tuple[int, str]:
    """--num-prompts: N, or N:self."""
    count, _, chat = text.partition(":")
    try:
        return int(count), chat or "grid"
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N:self (N prompts), got {text!r}") from None


def cmd_train_head(args: argparse.Namespace) -> int:
    checks.input_file(args.recipe, "recipe")
    from ..hardware import cpu
    from ..models.cache import cache_dir
    from ..models.load import load_model
    from ..recipe import load_recipe
    from ..training.heads import TrainConfig, check_train_config, consecutive_sets, train_head

    recipe = load_recipe(args.recipe)
    cfg = TrainConfig(kind=args.kind, steps=args.steps, lr=args.lr, heads=args.heads, batch_seqs=args.batch_seqs,
                      draft_vocab=args.draft_vocab or None, eval_every=args.eval_every, unroll=args.unroll,
                      dtype=args.dtype, init=args.init)
    data_cfgs = consecutive_sets(args.num_prompts or [192], new_tokens=args.new_tokens, source=args.source,
                                 dtype=args.dtype)
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
          + ", ".join(f"{a:.2f}" for a in rounds)
          + f" ({card['held_out']['tokens_per_target_pass_k3']:.2f} tokens per target pass)")
    method = "eagle" if args.kind == "eagle3" else args.kind
    print(f"head: {output} (config.json, model.safetensors, card.json); use it with draft.method: {method}, "
          f"draft.head: {output}")
    return 0


def cmd_train_exit_head(args: argparse.Namespace) -> int:
    checks.input_dir(args.corpus, "--corpus")
    checks.output_file(args.output, "-o")
    from ..heads.exit import save_adapter
    from ..models.load import load_model
    from ..training.exit_head import TrainConfig, train_exit_head
    from .format import table

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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register models, train-head and train-exit-head."""
    p = sub.add_parser("train-head", help="train a Medusa or EAGLE draft head on the recipe's target (CPU, self-distillation)",
                       description="Train a Medusa or EAGLE draft head on the recipe's target (CPU, self-distillation); "
                                   "docs/heads.md explains the data and the options.")
    p.add_argument("recipe", type=Path, help="recipe whose target.model the head drafts for")
    p.add_argument("--kind", required=True, choices=("medusa", "eagle", "eagle3"),
                   help="eagle: EAGLE-1/2 (last-layer feature); eagle3: EAGLE-3 (low, middle and high layers fused); "
                        "both run as draft.method eagle")
    count = p.add_argument("--num-prompts", type=_prompt_set, action="append", metavar="N[:self]",
                           help="offline prompts the target answers (half code, half chat; default 192); repeat it to add "
                                "sets of further prompts to a head's data (each set cached on its own, so adding one to a "
                                "trained head's command answers only the new prompts and resumes training); N:self: the "
                                "set's chat prompts are user messages the target writes itself (sampled) instead of "
                                "templated ones")
    deprecated_alias(p, "--prompts", count)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens the target writes per answer")
    p.add_argument("--source", choices=("answers", "text"), default="answers",
                   help="answers: the target answers offline prompts (best, one target step per token); text: "
                        "teacher-forced windows of standard-library source (--num-prompts windows of 256 tokens; cheap)")
    p.add_argument("--steps", type=int, default=600, help="training steps")
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
                   help="the target's passes and the training matmuls; bfloat16 is faster on CPUs with AMX "
                        "(Sapphire Rapids and later) and slower on others; the head's weights stay float32")
    p.add_argument("-o", "--output", type=Path, help="head directory (default heads/<target>-<kind>); rerunning resumes")
    p.set_defaults(func=cmd_train_head)

    p = sub.add_parser("train-exit-head", help="train an early-exit adapter on a local text corpus (CPU)",
                       description="Train an early-exit adapter on a local text corpus (CPU).")
    p.add_argument("model", help="catalog name, Hugging Face directory or .gguf file (the target)")
    p.add_argument("--layer", type=int, required=True, help="exit after this many layers (draft.layer)")
    p.add_argument("--corpus", type=Path, help="directory of text files (default: the Python standard library)")
    p.add_argument("--train-tokens", type=int, default=60_000, help="corpus tokens trained on")
    p.add_argument("--eval-tokens", type=int, default=6_000, help="held-out corpus tokens the report is measured on")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--rank", type=int, default=None, help="adapter width (default: the hidden size)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    p.add_argument("-o", "--output", type=Path, required=True, help="adapter file (.safetensors); a .json report goes beside it")
    p.set_defaults(func=cmd_train_exit_head)

    p = sub.add_parser("models", help="the offline model catalog", description="The offline model catalog: what each "
                       "model is, where its weights come from, and whether a model compiles.")
    msub = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=type(p))
    lst = msub.add_parser("list", help="catalog models, their sources and whether they are pulled",
                          description="Catalog models, their sources and whether they are pulled.")
    lst.add_argument("--families", action="store_true", help="the model families specc compiles (markdown table)")
    check = msub.add_parser("check", help="would this model compile? which family, or what is missing (reads config.json only)",
                            description="Would this model compile? Which family, or what is missing (reads config.json only).")
    check.add_argument("model", help="catalog name, Hugging Face model directory or config.json")
    pull = msub.add_parser("pull", help="download, assemble, verify and convert a catalog model",
                           description="Download, assemble, verify (sha256) and convert a catalog model.")
    pull.add_argument("name", help="catalog name (`specc models list`)")
    p.set_defaults(func=cmd_models)
