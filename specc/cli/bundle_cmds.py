"""Subcommands that build, show or deploy a bundle, and the machine reports: compile, inspect, serve,
triton, doctor, trt-check, passes.

Each command checks its inputs before it imports what loads models (torch), so a wrong invocation
answers at once."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import SpeccError
from . import checks
from .parser import (RawEpilogHelpFormatter, add_context_settings, add_json, add_trust, add_verify, add_warm,
                     deprecated_alias, json_file, k_value)
from .run_cmds import write_json



class ApiKeys(argparse.Action):
    """--api-key, repeatable: the keys given replace the default ($SPECC_API_KEY) instead of joining it."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (given if isinstance(given, list) else []) + [value])

def _recipe_help() -> str:
    from ..recipe import describe_schema

    return "recipe fields (YAML; see recipes/README.md and recipes/quickstart.yaml):\n" + "\n".join(describe_schema())


def cmd_compile(args: argparse.Namespace) -> int:
    checks.input_file(args.recipe, "recipe")
    from ..bundle import read_manifest
    from ..compiler import compile_recipe
    from ..recipe import load_recipe

    recipe = load_recipe(args.recipe)
    path = compile_recipe(recipe, output=args.output, dump_graphs=args.dump_graphs, progress=not args.quiet)
    print(f"bundle written to {path}\nbundle id {read_manifest(path).id} (pin it with --expect-id)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    checks.bundle_dir(args.bundle)
    checks.output_file(json_file(args))
    from ..bundle import open_bundle
    from .format import format_manifest, terminal_safe

    bundle = open_bundle(args.bundle, verify=not args.no_verify, expect_id=args.expect_id)
    if args.json is None or json_file(args):
        print(terminal_safe(format_manifest(bundle.manifest, bundle.path, verified=not args.no_verify)))
    write_json(args, {"id": bundle.id, "manifest": bundle.manifest.raw})
    return 0


def cmd_triton(args: argparse.Namespace) -> int:
    checks.bundle_dir(args.bundle)
    checks.at_least(args.max_new_tokens, "--max-new-tokens")
    if args.repo.exists() and not args.repo.is_dir():
        raise SpeccError(f"--repo {args.repo} exists and is not a directory; allowed a new or empty directory")
    from ..triton import write_repository

    plans = write_repository(args.bundle, args.repo, name=args.name, layout=args.layout, engines=args.engines,
                             force=args.force, default_max_tokens=args.max_new_tokens, expect_id=args.expect_id,
                             trust_code=args.trust_code)
    print(f"Triton model repository written to {args.repo} (layout {args.layout}):")
    for plan in plans:
        print(f"  {plan.name:<24} {plan.summary}")
    print(f"serve it with `tritonserver --model-repository {args.repo}` (the server's Python environment needs specc); "
          f"clients call model {plans[0].name!r}, see docs/triton.md")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serving import serve

    checks.bundle_dir(args.bundle)
    if not 0 <= args.port <= 65535:
        raise SpeccError(f"--port {args.port}: allowed 0 to 65535 (0: any free port)")
    checks.at_least(args.max_batch, "--max-batch")
    checks.at_least(args.max_queue, "--max-queue")
    texts = checks.warm_file(args.warm)
    checks.input_file(args.chat_template, "--chat-template")
    if not args.shutdown_timeout >= 0:
        raise SpeccError(f"--shutdown-timeout {args.shutdown_timeout}: allowed a number of seconds >= 0")
    if not args.max_body_mb > 0:
        raise SpeccError(f"--max-body-mb {args.max_body_mb}: allowed a number of MiB > 0")
    checks.at_least(args.prefix_cache_mb, "--prefix-cache-mb", low=0)
    checks.at_least(args.prefill_chunk, "--prefill-chunk")
    serve(args.bundle, warm=texts, host=args.host, port=args.port, name=args.name, api_key=args.api_key,
          k=args.k, speculative=not args.no_speculation, max_batch=args.max_batch,
          max_queue=args.max_queue, verify=not args.no_verify, expect_id=args.expect_id, trust_code=args.trust_code,
          chat_template=args.chat_template, shutdown_timeout=args.shutdown_timeout, max_body_mb=args.max_body_mb,
          prefix_cache_mb=args.prefix_cache_mb, prefill_chunk=args.prefill_chunk)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .format import doctor_report

    print(doctor_report())
    return 0


def cmd_trt_check(args: argparse.Namespace) -> int:
    checks.input_file(args.onnx, "ONNX file")
    from ..backends.trt_coverage import check_onnx, format_report

    report = check_onnx(args.onnx)
    print(format_report(report))
    return 0 if report.ok else 1


def cmd_passes(args: argparse.Namespace) -> int:
    from ..onnx_passes import describe_onnx_passes
    from ..passes import describe_passes

    print("FX passes (step graphs, before export):\n" + describe_passes())
    print("\nONNX passes (exported graphs, by backend):\n" + describe_onnx_passes())
    return 0


def add_compile_parser(sub: argparse._SubParsersAction) -> None:
    """Register compile (first in `specc --help`: every other command starts from its bundle)."""
    p = sub.add_parser("compile", help="build a bundle from a recipe", description="Build a bundle from a recipe.",
                       epilog_factory=_recipe_help, formatter_class=RawEpilogHelpFormatter)
    p.add_argument("recipe", type=Path, help="recipe YAML file")
    p.add_argument("-o", "--output", type=Path, help="bundle directory (default: the recipe's output)")
    p.add_argument("--dump-graphs", type=Path, metavar="DIR", help="write each graph's summary and code after the passes here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compile)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register inspect, serve, triton, doctor, trt-check and passes."""
    p = sub.add_parser("inspect", help="show a bundle's manifest", description="Show a bundle's manifest.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    add_json(p, "the bundle id and manifest")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check (sizes and listing are still checked)")
    p.add_argument("--expect-id", metavar="ID", help="refuse the bundle unless its id is ID")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API (docs/serving.md)",
                       description="OpenAI-compatible server: /v1/completions, /v1/chat/completions (streaming or "
                                   "not), /v1/models, /health, /metrics (Prometheus). Requests join the running batch "
                                   "between rounds; speculation adapts k to the load (--k auto). Needs the serve extra: "
                                   "pip install 'specc[serve]'.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port)")
    p.add_argument("--name", help="the model name clients send (default: the bundle directory's name)")
    p.add_argument("--api-key", action=ApiKeys, default=os.environ.get("SPECC_API_KEY"),
                   help="require the header Authorization: Bearer API_KEY on every route but /health and /metrics "
                        "(default: $SPECC_API_KEY, which keeps the key out of the process list; several "
                        "--api-key: any of them, each client key its own prefix-cache domain)")
    p.add_argument("--max-batch", type=int, default=None, help="most rows per round (default: the bundle's limits.max_batch)")
    p.add_argument("--max-queue", type=int, default=256, help="most sequences waiting for a row; more answer 429, "
                   "and a request of more sequences than this 400")
    p.add_argument("--k", type=k_value, default="auto", help="draft tokens per round, or auto")
    p.add_argument("--no-speculation", action="store_true", help="serve the target alone (the baseline)")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions, instead of the tokenizer's (or where it has none)")
    p.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, stop taking requests and give those in flight up to S seconds to "
                        "finish; the rest end with an error (a second signal stops at once)")
    p.add_argument("--max-body-mb", type=float, default=8.0, metavar="MB",
                   help="largest request body in MiB; larger ones answer 413 before they are read")
    add_warm(p)
    add_context_settings(p)
    add_verify(p)
    add_trust(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("triton", help="write a Triton Inference Server model repository that serves a bundle",
                       description="Write a Triton model repository: the speculative orchestrator as a python-backend "
                                   "model in decoupled mode (streams tokens as rounds accept them). docs/triton.md "
                                   "compares the layouts and lists the model's inputs and outputs.")
    p.add_argument("bundle", type=Path, help="bundle directory (`specc compile`)")
    p.add_argument("--repo", type=Path, required=True, help="the model repository directory to write")
    p.add_argument("--name", help="the model clients call (default: the bundle directory's name)")
    p.add_argument("--layout", choices=["in-process", "split"], default="in-process",
                   help="in-process: one python model runs the whole bundle (every backend); split: target and draft "
                        "are separate Triton models the orchestrator calls with BLS")
    p.add_argument("--engines", choices=["native", "python"], default="native",
                   help="split layout: serve the graphs with Triton's onnxruntime_onnx / tensorrt_plan platform "
                        "(native), or with python-backend models running the bundle's backend")
    tokens = p.add_argument("--max-new-tokens", type=int, default=64,
                            help="most tokens generated for requests that do not set max_tokens")
    deprecated_alias(p, "--default-max-tokens", tokens)
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty repository (replaces model directories of the same names)")
    add_trust(p)
    p.set_defaults(func=cmd_triton)

    p = sub.add_parser("doctor", help="which backends, devices and versions this machine has",
                       description="Which backends, devices and versions this machine has.")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("trt-check", help="check an ONNX file against TensorRT's supported operators (no TensorRT needed)",
                       description="Check an ONNX file against TensorRT's supported operators (no TensorRT needed).")
    p.add_argument("onnx", type=Path, help="ONNX file (a bundle's graphs/*/model.onnx)")
    p.set_defaults(func=cmd_trt_check)

    p = sub.add_parser("passes", help="list the graph passes (FX and ONNX) with their contracts",
                       description="List the graph passes with their contracts.")
    p.set_defaults(func=cmd_passes)
