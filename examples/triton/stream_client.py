"""Stream from the speculative orchestrator over gRPC (tritonclient); several --prompt are sent at once.

    .venv/bin/python examples/triton/stream_client.py --model tiny --prompt "def fib(n):" --max-new-tokens 32
    .venv/bin/python examples/triton/stream_client.py --model tiny --prompt a --prompt b --json

One prompt: its text is printed as the rounds accept it, then its speculation stats. --json prints
every request's result (text, token ids, finish reason, stats, or the server's error message).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specc.triton.client import stream_many, stream_one


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC address")
    p.add_argument("--model", required=True, help="the orchestrator model's name (`specc triton --name`)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: sent at once)")
    p.add_argument("--max-new-tokens", type=int, help="the request's max_tokens (unset: the repository's default)")
    # the earlier name, hidden: commands written with it keep working
    p.add_argument("--max-tokens", type=int, dest="max_new_tokens", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--temperature", type=float, help="0 = greedy (unset: the bundle's recipe)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (unset: the bundle's recipe)")
    p.add_argument("--top-k", type=int, help="sample among the K most likely tokens (unset: the bundle's recipe)")
    p.add_argument("--seed", type=int, help="random seed of sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print every request's result as JSON")
    args = p.parse_args()
    settings = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed, "stop": args.stop, "chat": args.chat or None}
    requests = [{"text_input": prompt, **{k: v for k, v in settings.items() if v is not None}} for prompt in args.prompt]
    if len(requests) == 1 and not args.json:
        printed = 0

        def show(text: str) -> None:
            nonlocal printed
            print(text[printed:], end="", flush=True)
            printed = len(text)

        result = stream_one(args.url, args.model, requests[0], on_text=show)
        print()
        if result.error:
            print(f"error: {result.error}", file=sys.stderr)
            return 1
        print(f"[{result.finish_reason}; {result.num_output_tokens} tokens in {result.responses} responses; "
              f"speculation {json.dumps(result.speculation_stats)}]", file=sys.stderr)
        return 0
    results = stream_many(args.url, args.model, requests)
    print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
