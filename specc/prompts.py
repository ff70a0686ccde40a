"""Benchmark prompt sets built reproducibly from offline sources.

code: the opening of real functions from the Python standard library (signature, docstring
and the first body lines), asking the model to continue them. chat: a fixed list of varied
questions and instructions, sent through the chat template. Neither is tuned to any system.
"""
from __future__ import annotations

import ast
import inspect
import json
import random
from pathlib import Path

STDLIB_MODULES = ("textwrap", "json.encoder", "heapq", "bisect", "shlex", "fractions", "statistics", "difflib",
                  "string", "calendar", "base64", "ipaddress", "pathlib", "configparser", "csv", "html")

CHAT = (
    "What is the capital of France, and what is it famous for?",
    "Explain recursion to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "Give me three tips for writing clean code.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do I make a cup of green tea?",
    "Why is the sky blue?",
    "List five fruits that are high in vitamin C.",
    "Write a short, polite email declining a meeting invitation.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Explain what a hash table is and when to use one.",
    "Suggest a name for a friendly robot dog.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in simple terms.",
    "How does a binary search work?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What is the Pythagorean theorem?",
    "Write two sentences encouraging someone learning to program.",
)


def function_openings(source: str, body_lines: int = 2, decorators: bool = True, dunders: bool = False) -> list[str]:
    """Openings of the functions in one module's source (80 to 1200 characters): signature, docstring
    and the first body_lines lines of the body after it; decorators: start at the decorator lines;
    dunders: also `__name__` methods."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and len(node.body) > body_lines + 1 and (dunders or not node.name.startswith("__")):
            first = node.body[1 if ast.get_docstring(node) else 0]
            start = node.lineno - 1 - (len(node.decorator_list) if decorators else 0)
            text = "\n".join(lines[start: first.lineno - 1 + body_lines])
            if 80 <= len(text) <= 1200:
                found.append(inspect.cleandoc("\n" + text) + "\n")
    return found


def code_prompts(n: int, seed: int = 0, body_lines: int = 2) -> list[str]:
    """n function openings from the standard library, chosen with a fixed seed."""
    import importlib

    found = []
    for name in STDLIB_MODULES:
        found += function_openings(inspect.getsource(importlib.import_module(name)), body_lines)
    random.Random(seed).shuffle(found)
    return found[:n]


WARMUP_MODULE = "colorsys"  # not a benchmark module
WARMUP_CHAT = ("Name three uses of a paper clip.", "What does a compiler do?")


def warmup_items() -> list[dict]:
    """Four prompts outside every benchmark set (two code, two chat): what an adaptive policy learns on
    before it is timed, as a running server has learned from earlier requests."""
    import importlib

    code = function_openings(inspect.getsource(importlib.import_module(WARMUP_MODULE)))[:2]
    return ([{"prompt": p, "chat": False, "kind": "code"} for p in code]
            + [{"prompt": p, "chat": True, "kind": "chat"} for p in WARMUP_CHAT])


def build(n_code: int, n_chat: int, seed: int = 0) -> list[dict]:
    items = [{"prompt": p, "kind": "code"} for p in code_prompts(n_code, seed)]
    items += [{"prompt": p, "chat": True, "kind": "chat"} for p in CHAT[:n_chat]]
    return items


def write(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", type=int, default=16)
    ap.add_argument("--chat", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    write(args.output, build(args.code, args.chat, args.seed))
