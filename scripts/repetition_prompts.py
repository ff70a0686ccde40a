"""Write the repetition workloads of examples/prompts/ (suffix decoding's home ground), reproducibly.

- repeat-code-edit.jsonl: multi-turn code editing: a file and a change to make, reply with the whole file;
  several turns on each of two files (each turn's prompt holds the file, as an assistant resends it).
- repeat-agent-json.jsonl: an agent loop: the same tool schema every call, a task and the tool results so
  far; the reply is the next tool call as one JSON object.
- repeat-questions.jsonl: the same few questions asked again with small variations in wording.
- repeat-24.jsonl: the three in that order, for one `specc bench` run (its results split by "kind").
- repeat-12.jsonl: the first four of each, in that order: the same workloads for larger models, in a third
  of the time.

All go through the chat template. Prompts run in file order, so later requests can draft from earlier ones'
outputs: that order is part of the workload.

    python scripts/repetition_prompts.py   # rewrites the three files
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "prompts"

FILES = {
    "inventory.py": '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
''',
    "shapes.py": '''import math


def circle_area(radius):
    return math.pi * radius * radius


def square_area(side):
    return side * side


def describe(shape, size):
    if shape == "circle":
        return "circle of area " + str(circle_area(size))
    return "square of area " + str(square_area(size))
''',
}

EDITS = {
    "inventory.py": ["Rename the method `total` to `count_all`.",
                     "Add a docstring to every method.",
                     "Make `remove` delete the item when its count reaches zero.",
                     "Add a method `names` that returns the sorted item names."],
    "shapes.py": ["Add a function `triangle_area(base, height)`.",
                  "Use f-strings in `describe`.",
                  "Add type hints to every function.",
                  "Make `describe` raise ValueError for an unknown shape."],
}

TOOLS = '''You are an agent. Call exactly one tool per reply, as one JSON object of this form and nothing else:
{"tool": "<name>", "arguments": {...}}
Tools:
- get_weather: {"city": string, "unit": "celsius" or "fahrenheit"}
- search_web: {"query": string, "max_results": integer}
- send_email: {"to": string, "subject": string, "body": string}
- create_event: {"title": string, "date": "YYYY-MM-DD", "time": "HH:MM"}'''

TASKS = [
    ("What's the weather in Paris today?", []),
    ("What's the weather in Tokyo in fahrenheit?", []),
    ("Find recent news about solar panels.", []),
    ("Email Bob that the meeting moved to Friday.", []),
    ("Put a dentist appointment on 2026-03-14 at 09:30 in my calendar.", []),
    ("What's the weather in Berlin, and email it to anna@example.com.",
     ['{"tool": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}} -> 12 degrees, cloudy']),
    ("Find three articles about electric cars.", []),
    ("Email carol@example.com the summary of the search results.",
     ['{"tool": "search_web", "arguments": {"query": "electric cars", "max_results": 3}} -> 3 results about battery prices']),
]

QUESTIONS = [
    "How do I reverse a list in Python?",
    "What is the capital of Australia?",
    "How can I reverse a Python list?",
    "Explain what a hash table is.",
    "What's the capital city of Australia?",
    "how to reverse a list in python",
    "Can you explain what a hash table is?",
    "Which city is the capital of Australia?",
]


def code_edit() -> list[dict]:
    out = []
    for name, text in FILES.items():
        for edit in EDITS[name]:
            out.append({"prompt": f"Here is {name}:\n```python\n{text}```\n{edit} Reply with the complete updated file "
                                  "in one code block, nothing else.", "chat": True, "kind": "code-edit"})
    return out


def agent_json() -> list[dict]:
    out = []
    for task, history in TASKS:
        done = "".join(f"\nTool call so far: {h}" for h in history)
        out.append({"prompt": f"{TOOLS}\n\nTask: {task}{done}\nNext tool call:", "chat": True, "kind": "agent-json"})
    return out


def questions() -> list[dict]:
    return [{"prompt": q, "chat": True, "kind": "questions"} for q in QUESTIONS]


def main() -> None:
    sets = (("repeat-code-edit", code_edit()), ("repeat-agent-json", agent_json()), ("repeat-questions", questions()))
    whole = (("repeat-24", [r for _, rows in sets for r in rows]), ("repeat-12", [r for _, rows in sets for r in rows[:4]]))
    for name, rows in sets + whole:
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
