"""Long contexts and prefix reuse on one bundle, in one process (docs/benchmarks.md, "Long contexts").

1. Context sweep: a source file cut to N tokens with an editing instruction after it, 64 new tokens,
   greedy, one request at a time: time to first token (the prefill) and decode tokens/s, target-only
   and speculative (the bundle's drafter: prompt lookup for the quickstart), and llama.cpp on the
   model's GGUF where a llama.cpp binding is installed (--llamacpp-gguf; the `llamacpp` extra).
2. A 6-turn chat whose history grows to ~2k tokens, with the prefix cache off and on: each turn's
   time to first token and the run's total, outputs compared turn for turn.
3. 8 users sharing one ~800-token system prompt, submitted together: time to first token per user,
   total time and the prefix cache's hit rate, off and on.

  PYTHONPATH=. python scripts/bench_long_context.py /tmp/qs8k --contexts 512,2048,8000 --json out.json

Without --prefix-cache the script also runs where the runtime has no prefix cache (an older
checkout, for a same-machine before/after of the sweep).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import statistics
import sys
import time
import typing
from pathlib import Path

import specc
from specc.hardware import cpu

INSTRUCTION = "\n\n# Task: rewrite the code above with type hints on every function. The rewritten code:\n"


def source_text() -> str:
    """A long, real Python file: the standard library's typing module (and more, if needed)."""
    return inspect.getsource(typing) + inspect.getsource(argparse)


def set_cache(model, mb: int) -> None:
    if hasattr(model, "set_prefix_cache_mb"):
        model.set_prefix_cache_mb(mb)


def timed(model, prompts: list[list[int]], max_new: int, **kw) -> dict:
    """Generate for the prompts together; each request's time to first token, the decode rate of the first."""
    start = time.perf_counter()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for ev in model.stream(prompts, max_new_tokens=max_new, **kw):
        now = time.perf_counter()
        if ev.token_ids and ev.index not in first:
            first[ev.index] = now
        last[ev.index] = now
        tokens[ev.index] += ev.token_ids
    end = time.perf_counter()
    ttft = [first[i] - start for i in range(len(prompts))]
    n0 = len(tokens[0])
    decode = (n0 - 1) / (last[0] - first[0]) if n0 > 1 and last[0] > first[0] else None
    return {"ttft_s": ttft, "total_s": end - start, "decode_tok_s": decode, "tokens": [tokens[i] for i in range(len(prompts))]}


def sweep(model, contexts: list[int], max_new: int, llama, unchunked_max: int, systems: set[str]) -> list[dict]:
    tok = model.tokenizer
    text_ids = tok(source_text(), add_special_tokens=False)["input_ids"]
    instr = tok(INSTRUCTION, add_special_tokens=False)["input_ids"]
    rows = []
    for n in contexts:
        prompt = text_ids[: n - len(instr)] + instr
        row = {"context": len(prompt)}
        chunk = model.prefill_chunk
        for name, spec, whole in (("target_only", False, False), ("target_only_unchunked", False, True),
                                  ("speculative", True, False)):
            if name not in systems or whole and (not hasattr(model, "prefill_chunk") or len(prompt) > unchunked_max):
                continue
            model.prefill_chunk = 10**9 if whole else chunk  # unchunked: the whole prompt in one pass
            r = timed(model, [prompt], max_new, speculative=spec)
            model.prefill_chunk = chunk
            row[name] = {"ttft_s": r["ttft_s"][0], "prefill_tok_s": len(prompt) / r["ttft_s"][0],
                         "decode_tok_s": r["decode_tok_s"], "tokens": len(r["tokens"][0])}
            row.setdefault("outputs", []).append(r["tokens"][0])
            print(f"  {len(prompt):>6} {name:<22} ttft {r['ttft_s'][0]:7.2f} s  decode {r['decode_tok_s'] or 0:6.1f} tok/s",
                  flush=True)
        row["equal"] = all(o == row["outputs"][0] for o in row["outputs"])
        del row["outputs"]
        if llama is not None and "llamacpp" in systems:
            row["llamacpp"] = run_llama(llama, prompt, max_new, model.eos_ids)
            print(f"  {len(prompt):>6} llama.cpp    ttft {row['llamacpp']['ttft_s']:7.2f} s  decode "
                  f"{row['llamacpp']['decode_tok_s']:6.1f} tok/s", flush=True)
        rows.append(row)
    return rows


def run_llama(llm, prompt: list[int], max_new: int, eos: set[int]) -> dict:
    """llama.cpp greedy on the same token ids: time to first token and decode rate (a fresh context each time)."""
    llm.reset()
    start = time.perf_counter()
    first = None
    n = 0
    for t in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
        now = time.perf_counter()
        first = first or now
        n += 1
        if t in eos or n >= max_new:
            break
    end = time.perf_counter()
    return {"ttft_s": first - start, "prefill_tok_s": len(prompt) / (first - start),
            "decode_tok_s": (n - 1) / (end - first) if n > 1 else None, "tokens": n}


def chat(model, mb: int, max_new: int) -> dict:
    """Six turns; each user message is a slice of the source file and a question about it."""
    set_cache(model, mb)
    tok = model.tokenizer
    text = source_text()
    messages = [{"role": "system", "content": "You are a careful Python reviewer. Answer briefly."}]
    turns = []
    for i in range(6):
        piece = text[i * 1000:(i + 1) * 1000]
        messages.append({"role": "user", "content": f"Here is more of the file:\n{piece}\nWhat does this part do?"})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        r = timed(model, [list(ids)], max_new)
        messages.append({"role": "assistant", "content": tok.decode(r["tokens"][0], skip_special_tokens=True)})
        turns.append({"prompt_tokens": len(ids), "ttft_s": r["ttft_s"][0], "total_s": r["total_s"], "tokens": r["tokens"][0]})
        print(f"  cache {mb:>4} MB turn {i + 1}: {len(ids):>5} tokens, ttft {r['ttft_s'][0]:6.2f} s", flush=True)
    return {"turns": turns, "total_s": sum(t["total_s"] for t in turns)}


def shared_system(model, mb: int, max_new: int, users: int = 8) -> dict:
    set_cache(model, mb)
    tok = model.tokenizer
    system = "You are the assistant of a software team. Their style guide follows.\n" + source_text()[:3000]
    prompts = []
    for u in range(users):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"User {u}: in one sentence, what is rule number {u + 1} about?"}]
        prompts.append(list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)))
    r = timed(model, prompts, max_new)
    cache = getattr(model, "prefix_cache", None)
    out = {"prompt_tokens": [len(p) for p in prompts], "ttft_s": r["ttft_s"], "mean_ttft_s": statistics.mean(r["ttft_s"]),
           "total_s": r["total_s"], "tokens": r["tokens"]}
    if cache is not None and mb:
        out["hit_rate"] = cache.hits / cache.queries if cache.queries else 0.0
        out["cache_bytes"] = cache.bytes
    print(f"  cache {mb:>4} MB: {users} users, mean ttft {out['mean_ttft_s']:.2f} s, total {r['total_s']:.2f} s"
          + (f", hit rate {out.get('hit_rate', 0):.2f}" if "hit_rate" in out else ""), flush=True)
    return out


def interleave(model, context: int, budget_s: float) -> dict:
    """A short request decodes (target-only) while a `context`-token prompt is prefilled beside it: the short
    row's time between tokens before and after (idle) and during the long prefill."""
    from specc.runtime.scheduler import Scheduler

    tok, params = model.tokenizer, model.sampling_params()
    long_ids = tok(source_text(), add_special_tokens=False)["input_ids"][:context]
    code = tok(source_text(), add_special_tokens=False)["input_ids"]
    # a fresh process pages its weights in and sizes its buffers over the first passes: not the idle pace
    model.generate([code[-100:]], max_new_tokens=16, speculative=False)
    model.generate([long_ids[:2 * model.prefill_chunk]], max_new_tokens=2, speculative=False)
    scheduler = Scheduler(model, speculative=False)
    # code goes on (a story may end at once), long enough to outlast the prefill where the context allows
    row_tokens = min(4000, model.max_context - 101)  # k 0: this row decodes without speculation
    scheduler.submit(model.new_request(0, code[-100:], row_tokens, params, 0))
    gaps: dict[str, list[float]] = {"idle": [], "prefilling": [], "after": []}
    last, entered = None, len(long_ids)
    for phase in gaps:
        if phase == "prefilling":
            scheduler.submit(model.new_request(1, long_ids, 4, params, 1))
            deadline = time.perf_counter() + budget_s
        if phase == "after":  # idle again: the machine's pace may drift over a long run
            if scheduler.prefilling is not None:
                entered = sum(scheduler.prefilling.entered)
            scheduler.cancel(1)
            last = None
        while scheduler.busy:
            events = scheduler.step()
            now = time.perf_counter()
            if any(e.index == 0 and e.token_ids for e in events):
                if last is not None and (phase != "after" or scheduler.prefilling is None):
                    gaps[phase].append(now - last)
                last = now
            if phase != "prefilling" and len(gaps[phase]) >= 20:
                break
            if phase == "prefilling" and (scheduler.prefilling is None and any(e.index == 1 for e in events)
                                          or now > deadline):  # past the deadline the prompt need not finish
                break
    # the mean, not the median: chunks that run every few rounds leave most gaps at the idle pace
    idle, busy = statistics.mean(gaps["idle"] + gaps["after"]), statistics.mean(gaps["prefilling"])
    print(f"  inter-token latency of a decoding row: idle {idle * 1000:.0f} ms (before "
          f"{statistics.mean(gaps['idle']) * 1000:.0f}, after {statistics.mean(gaps['after']) * 1000:.0f}), beside a "
          f"{context}-token prefill {busy * 1000:.0f} ms (mean of {len(gaps['prefilling'])}, median "
          f"{statistics.median(gaps['prefilling']) * 1000:.0f} ms, max {max(gaps['prefilling']) * 1000:.0f} ms; "
          f"{entered} of {len(long_ids)} prompt tokens entered)", flush=True)
    return {"context": context, "idle_itl_s": idle, "idle_before_itl_s": statistics.mean(gaps["idle"]),
            "idle_after_itl_s": statistics.mean(gaps["after"]), "prefilling_itl_s": busy,
            "median_prefilling_itl_s": statistics.median(gaps["prefilling"]), "max_prefilling_itl_s": max(gaps["prefilling"]),
            "tokens_during_prefill": len(gaps["prefilling"]), "ratio": busy / idle,
            "prompt_tokens_entered": entered, "prefill_finished": entered == len(long_ids)}


def as_results(result: dict, drafter: str) -> dict:
    """The sweep as the rows of a docs/results file (`specc report` renders them): per context, each system's
    decode tokens/s (vs target-only at the sweep's first context), its time to first token in the note."""
    systems = {}
    sweep_rows = result.get("sweep") or []
    names = {"target_only": "specc target-only", "target_only_unchunked": "specc target-only, unchunked prefill",
             "speculative": f"specc {drafter}", "llamacpp": "llama.cpp target-only"}
    for row in sweep_rows:
        for key, label in names.items():
            r = row.get(key)
            if r is None:
                continue
            same = "n/a" if key == "llamacpp" else ("1/1" if key.startswith("target_only") or row["equal"] else "0/1")
            systems[f"{label}, {row['context']}-token prompt"] = {
                "tokens_per_second": round(r["decode_tok_s"], 2) if r.get("decode_tok_s") else None,
                "ttft_s": round(r["ttft_s"], 2), "prefill_tokens_per_second": round(r["prefill_tok_s"], 1),
                "note": f"prefill {r['ttft_s']:.1f} s ({r['prefill_tok_s']:.0f} prompt tokens/s)", "outputs_equal": same}
    reference = f"specc target-only, {sweep_rows[0]['context']}-token prompt" if sweep_rows else None
    ref = systems.get(reference, {}).get("tokens_per_second")
    for entry in systems.values():
        tps = entry["tokens_per_second"]
        entry["speedup_vs_reference"] = round(tps / ref, 2) if tps and ref else None
    return {"measured_by": "scripts/bench_long_context.py", "provenance": "measured", "reference": reference,
            "prompts": 1, "repeats": 1, "batch_size": 1, "systems": systems}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--contexts", default="512,2048,8000", help="prompt lengths of the sweep (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--llamacpp-gguf", type=Path, help="the same model as GGUF for llama.cpp (the llamacpp extra)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: usable cores)")
    p.add_argument("--prefix-cache", type=int, default=0, metavar="MB",
                   help="also run the chat and shared-system-prompt benchmarks, with this cache budget (0: skip them)")
    p.add_argument("--skip-sweep", action="store_true", help="only the prefix-cache benchmarks")
    p.add_argument("--systems", default="target_only,target_only_unchunked,speculative,llamacpp",
                   help="which of the sweep's systems run (comma-separated)")
    p.add_argument("--unchunked-max", type=int, default=2048, metavar="TOKENS",
                   help="the sweep's whole-prompt prefill runs only up to this context (its mask and scores are "
                        "prompt by prompt)")
    p.add_argument("--interleave", type=int, default=0, metavar="TOKENS",
                   help="also measure a decoding row's inter-token latency beside a prefill of this many tokens")
    p.add_argument("--interleave-seconds", type=float, default=300.0, metavar="S",
                   help="--interleave: stop measuring after this long even if the long prompt is not prefilled yet")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = specc.load(args.bundle)
    set_cache(model, 0)
    llama = None
    if args.llamacpp_gguf:
        from specc.bench.llamacpp import open_llama

        llama = open_llama(args.llamacpp_gguf, args.threads, n_ctx=max(int(c) for c in args.contexts.split(",")) + 256)
    result = {"date": datetime.date.today().isoformat(), "machine": cpu(), "command": " ".join(sys.argv),
              "bundle": str(args.bundle), "max_new_tokens": args.max_new_tokens,
              "runtime": "prefix cache and chunked prefill" if hasattr(model, "prefix_cache") else "whole-prompt prefill"}
    if llama is not None:
        from specc.hardware import usable_cores

        result["llamacpp"] = {"gguf": str(args.llamacpp_gguf), "binding": llama.specc_binding,
                              "cpu_features": llama.specc_system_info, "threads": args.threads or usable_cores()}

    def save():
        if args.json:
            result.update(as_results(result, model.draft_label))
            args.json.write_text(json.dumps(result, indent=1))

    if not args.skip_sweep:
        result["sweep"] = sweep(model, [int(c) for c in args.contexts.split(",")], args.max_new_tokens, llama,
                                args.unchunked_max, set(args.systems.split(",")))
        save()
    if args.interleave:
        result["interleave"] = interleave(model, args.interleave, args.interleave_seconds)
        save()
    if args.prefix_cache:
        off, on = chat(model, 0, 32), chat(model, args.prefix_cache, 32)
        result["chat"] = {"off": off, "on": on, "equal": [a["tokens"] == b["tokens"] for a, b in zip(off["turns"], on["turns"])]}
        save()
        off, on = shared_system(model, 0, 16), shared_system(model, args.prefix_cache, 16)
        result["shared_system"] = {"off": off, "on": on, "equal": off["tokens"] == on["tokens"]}
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
