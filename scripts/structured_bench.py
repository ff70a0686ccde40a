"""Structured output under speculation: tokens per target pass and speed with and without a JSON schema,
and the grammar's mask time per verified position.

    python scripts/structured_bench.py BUNDLE {extract|agent} > out.json

Chat prompts, greedy, 48 new tokens, one prompt per call; each configuration runs target-only and
speculative on the same prompts, and the outputs are compared. `extract`: the model writes a record
from a sentence; `agent`: the record is in the prompt as a tool's output (where prompt lookup should
accept most). Mask time is the time in the grammar's masking (runtime/rules.py RowRule._mask) over the
positions it masked (every verified position, and every drafted one for drafters that draw).
"""
from __future__ import annotations

import json
import sys
import time

import specc
from specc.runtime import rules as R
from specc.runtime.stats import RunStats

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 20},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "city", "skills"], "additionalProperties": False}
PEOPLE = [("Alice", 31, "Paris", "python, sql"), ("Bob", 45, "Berlin", "welding"), ("Chen", 28, "Shanghai", "go, rust, k8s"),
          ("Dana", 52, "Austin", "sales")]


def prompts(workload: str) -> list[str]:
    if workload == "extract":
        return [f'Extract a JSON object with keys name, age, city, skills from: "{n} is {a} years old, lives in {c} '
                f'and knows {s}." Reply with the JSON only.' for n, a, c, s in PEOPLE]
    return [f'Tool output: {{"name":"{n}","age":{a},"city":"{c}","skills":["{s.split(", ")[0]}"]}}. '
            "Repeat the tool output as JSON." for n, a, c, s in PEOPLE]


def main(bundle: str, workload: str) -> dict:
    model = specc.load(bundle)
    timing = {"seconds": 0.0, "positions": 0}
    mask = R.RowRule._mask

    def timed(self, logits, drafts, start):
        t = time.perf_counter()
        mask(self, logits, drafts, start)
        timing["seconds"] += time.perf_counter() - t
        timing["positions"] += logits.shape[0]

    R.RowRule._mask = timed
    items = prompts(workload)
    model.generate(items[:1], max_new_tokens=8, chat=True)  # warm-up
    result = {}
    for name, schema in (("no schema", None), ("json_schema", SCHEMA)):
        rows = {}
        for speculative in (False, True):
            timing.update(seconds=0.0, positions=0)
            stats, outs, start = RunStats(), [], time.perf_counter()
            for p in items:
                outs += model.generate([p], max_new_tokens=48, chat=True, json_schema=schema, speculative=speculative)
                stats.merge(model.last_stats)
            wall, st = time.perf_counter() - start, stats.to_dict()
            tokens = sum(len(c.token_ids) for c in outs)
            rows["speculative" if speculative else "target-only"] = {
                "tokens": tokens, "seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2),
                "rounds": st["rounds"], "acceptance_rate": st["acceptance_rate"],
                "tokens_per_target_pass": st["tokens_per_target_pass"], "mask_positions": timing["positions"],
                "mask_us_per_position": round(1e6 * timing["seconds"] / timing["positions"], 1) if timing["positions"] else None,
                "outputs": [c.text for c in outs]}
        rows["speculative_equals_target_only"] = rows["speculative"]["outputs"] == rows["target-only"]["outputs"]
        result[name] = rows
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("extract", "agent"):
        sys.exit(__doc__)
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
