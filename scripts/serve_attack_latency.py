"""A normal request's latency on a live `specc serve`, alone and beside abusive requests.

    python scripts/serve_attack_latency.py BUNDLE [--pairs 15] [--max-tokens 12]

Starts `specc serve BUNDLE` on a free loopback port, then sends pairs of the same greedy request: one
alone, one while a 20 MB body, stop strings one past the caps (count, length), stop strings at the caps
(a valid request that runs beside it; --rejected-only leaves it out) and a 200k-character prompt are in
flight. Prints the median
and 90th percentile of both, the ratio, and what each attack was answered and how fast.

Then the schema attacks (tests/server_probe.py SCHEMA_ATTACKS: the 66-byte regex, a 60,000-value enum, an
unsatisfiable schema, one whose satisfiability search runs to its bound, one that compiles for seconds),
each sent once --streams innocent streams flow: the streams' largest gap between events beside it, against
their largest gap with no attack (idle) measured just before it, so both meet the same load from elsewhere
(--repeats pairs, medians).
--schemas-only skips the pairs; --json FILE writes both parts' numbers.
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
    ap.add_argument("--stream-tokens", type=int, default=64,
                    help="tokens of each innocent stream: enough for the streams to outlast the slowest attack")
    ap.add_argument("--repeats", type=int, default=3, help="pairs (alone, beside the attack) per schema attack")
    ap.add_argument("--schemas-only", action="store_true", help="only the schema-compile attacks")
    ap.add_argument("--only", nargs="+", choices=sorted(SCHEMA_ATTACKS), help="these schema attacks only")
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
    """Each schema attack beside innocent streams, in pairs: the streams' largest gap alone, then beside the
    attack (a new variant of its schema each time, so no cache answers it), both meeting the same load from
    elsewhere on the machine. The ratio is of the medians over the pairs."""
    body = {**NORMAL, "prompt": "innocent stream", "max_tokens": args.stream_tokens}
    gaps_beside(server, None, args.streams, body)  # warm-up
    print(f"{args.streams} innocent streams of {args.stream_tokens} tokens, {args.repeats} pairs per attack: "
          "median largest gap alone and beside it")
    out: dict = {"streams": args.streams, "stream_tokens": args.stream_tokens, "repeats": args.repeats, "attacks": {}}
    for name, schema in SCHEMA_ATTACKS.items():
        if args.only and name not in args.only:
            continue
        runs = []
        for i in range(args.repeats):
            idle, _, _, _ = gaps_beside(server, None, args.streams, body)
            variant = {**schema, "title": f"attack {i}"} if name != "enum_60000" else schema  # the enum is refused by size
            gaps, status, seconds, left = gaps_beside(server, schema_attack(server, variant), args.streams, body)
            runs.append({"status": status, "s": seconds, "streams_went_on_s": left, "idle_largest_gap_s": max(idle),
                         "largest_gap_s": max(gaps), "ratio_to_idle": max(gaps) / max(idle)})
        idle = statistics.median(r["idle_largest_gap_s"] for r in runs)
        beside = statistics.median(r["largest_gap_s"] for r in runs)
        ratio = beside / idle
        covered = all(r["streams_went_on_s"] > 0 for r in runs)
        each = " ".join(f"{r['ratio_to_idle']:.2f}x" for r in runs)
        print(f"  {name:<15} answered {sorted({str(r['status']) for r in runs})} in "
              f"{statistics.median(r['s'] for r in runs):.3f} s; largest gap {idle:.3f} s alone, {beside:.3f} s beside "
              f"it: {ratio:.2f}x (each pair: {each})"
              + ("" if covered else "  (the streams ended before its answer: raise --stream-tokens)"))
        out["attacks"][name] = {"runs": runs, "idle_largest_gap_s": idle, "largest_gap_s": beside, "ratio_to_idle": ratio,
                                "streams_outlasted_it": covered}
    worst = max(a["ratio_to_idle"] for a in out["attacks"].values())
    print(f"  worst ratio {worst:.2f}x")
    out["worst_ratio"] = worst
    return out


if __name__ == "__main__":
    sys.exit(main())
