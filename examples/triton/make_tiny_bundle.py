"""Compile a tiny random target + draft into a bundle in seconds (a byte-level tokenizer, so its
text is gibberish): enough to see the Triton plumbing work without downloading a model.

    .venv/bin/python examples/triton/make_tiny_bundle.py bundles/tiny
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from specc.compiler import compile_recipe
from specc.recipe import parse_recipe
from specc.testing import derive_draft, make_tiny_model


def main(out: str = "bundles/tiny") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny_model(Path(tmp) / "target", layers=3)
        draft = derive_draft(target, Path(tmp) / "draft", layers=2)
        recipe = parse_recipe({
            "target": {"model": str(target)},
            "draft": {"method": "model", "model": str(draft)},
            "speculation": {"k": 3},
            "limits": {"max_batch": 4, "max_context": 256},
            "backend": "onnxruntime",
        })
        print(f"bundle written to {compile_recipe(recipe, output=Path(out), progress=False)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
