"""A normal request's latency on a live `specc serve`, alone and beside abusive requests.

    python scripts/serve_attack_latency.py BUNDLE [--pairs 15] [--max-tokens 12]

Starts `specc serve BUNDLE` on a free loopback port, then sends pairs of the same greedy request: one
alone, one while a 20 MB body, stop strings one past the caps (count, length), stop strings at the caps
(a valid request that runs beside it; --rejected-only leaves it out) and a 200k-character prompt are in
flight. Prints the median
and 90th percentile of both, the ratio, and what each attack was answered and how fast.

Then the schema-compile attacks (the 66-byte regex, a 60,000-value enum, an unsatisfiable schema), each sent
once --streams innocent streams flow: each stream's largest gap between events beside it, against the
largest gap of the same streams with no attack (idle). --schemas-only skips the pairs; --json FILE writes
both parts' numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_probe import (NORMAL, SCHEMA_ATTACKS, LiveServer, gaps_beside, latency_under_attack,  # noqa: E402
                          normal_latency, schema_attack)

from specc.serving.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--rejected-only", action="store_true",
                    help="leave out the valid request at the stop-string caps (it shares the batch)")
    ap.add_argument("--streams", type=int, default=3, help="innocent streams beside each schema attack")
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--schemas-only", action="store_true", help="only the schema-compile attacks")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    body = {**NORMAL, "max_tokens": args.max_tokens}
    report: dict = {"bundle": str(args.bundle)}
    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer(args.bundle, Path(tmp) / "serve.log")
        try:
            if not args.schemas_only:
                normal_latency(server, 3, body)
                idle, attacked, results = latency_under_attack(server, args.pairs, (MAX_STOP_STRINGS, MAX_STOP_CHARS),
                                                               body, args.rejected_only)
                report["pairs"] = pairs_report(args, idle, attacked, results)
            report["schemas"] = schema_report(server, args)
        finally:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def pairs_report(args, idle: list[float], attacked: list[float], results: list) -> dict:
    def p90(xs):
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    print(f"normal request ({args.max_tokens} tokens, greedy), {args.pairs} pairs")
    print(f"  alone       median {statistics.median(idle):.3f} s   p90 {p90(idle):.3f} s")
    print(f"  beside them median {statistics.median(attacked):.3f} s   p90 {p90(attacked):.3f} s   "
          f"ratio of medians {statistics.median(attacked) / statistics.median(idle):.2f}")
    out = {"alone_s": idle, "attacked_s": attacked, "attacks": {}}
    for name in dict.fromkeys(n for n, _, _ in results):
        runs = [(status, s) for n, status, s in results if n == name]
        print(f"  {name:<15} answered {sorted({str(st) for st, _ in runs})}  "
              f"median {statistics.median(s for _, s in runs):.3f} s  "
              f"max {max(s for _, s in runs):.3f} s")
        out["attacks"][name] = [{"status": st, "s": s} for st, s in runs]
    return out


def schema_report(server: LiveServer, args) -> dict:
    """Each schema attack beside innocent streams: their largest gaps against the same streams' idle ones."""
    body = {**NORMAL, "prompt": "innocent stream", "max_tokens": args.stream_tokens}
    gaps_beside(server, None, args.streams, body)  # warm-up
    idle, _, _ = gaps_beside(server, None, args.streams, body)
    print(f"{args.streams} innocent streams of {args.stream_tokens} tokens: largest gap alone "
          + ", ".join(f"{g:.3f}" for g in idle) + " s")
    out = {"streams": args.streams, "stream_tokens": args.stream_tokens, "idle_largest_gap_s": idle, "attacks": {}}
    for name, schema in SCHEMA_ATTACKS.items():
        gaps, status, seconds = gaps_beside(server, schema_attack(server, schema), args.streams, body)
        ratio = max(gaps) / max(idle)
        print(f"  {name:<15} answered {status} in {seconds:.3f} s; largest gaps "
              + ", ".join(f"{g:.3f}" for g in gaps) + f" s: {ratio:.2f}x the idle largest")
        out["attacks"][name] = {"status": status, "s": seconds, "largest_gap_s": gaps, "ratio_to_idle": ratio}
    return out


if __name__ == "__main__":
    sys.exit(main())
