"""A normal request's latency on a live `specc serve`, alone and beside abusive requests.

    python scripts/serve_attack_latency.py BUNDLE [--pairs 15] [--max-tokens 12]

Starts `specc serve BUNDLE` on a free loopback port, then sends pairs of the same greedy request: one
alone, one while a 20 MB body, stop strings one past the caps (count, length), stop strings at the caps
(a valid request that runs beside it; --rejected-only leaves it out) and a 200k-character prompt are in
flight. Prints the median
and 90th percentile of both, the ratio, and what each attack was answered and how fast.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_probe import NORMAL, LiveServer, latency_under_attack, normal_latency  # noqa: E402

from specc.serving.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--rejected-only", action="store_true",
                    help="leave out the valid request at the stop-string caps (it shares the batch)")
    args = ap.parse_args()
    body = {**NORMAL, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer(args.bundle, Path(tmp) / "serve.log")
        try:
            normal_latency(server, 3, body)
            idle, attacked, results = latency_under_attack(server, args.pairs, (MAX_STOP_STRINGS, MAX_STOP_CHARS), body,
                                                           args.rejected_only)
        finally:
            server.stop()

    def p90(xs):
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    print(f"normal request ({args.max_tokens} tokens, greedy), {args.pairs} pairs")
    print(f"  alone       median {statistics.median(idle):.3f} s   p90 {p90(idle):.3f} s")
    print(f"  beside them median {statistics.median(attacked):.3f} s   p90 {p90(attacked):.3f} s   "
          f"ratio of medians {statistics.median(attacked) / statistics.median(idle):.2f}")
    for name in dict.fromkeys(n for n, _, _ in results):
        runs = [(status, s) for n, status, s in results if n == name]
        print(f"  {name:<15} answered {sorted({str(st) for st, _ in runs})}  median {statistics.median(s for _, s in runs):.3f} s  "
              f"max {max(s for _, s in runs):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
