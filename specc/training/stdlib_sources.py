"""Python standard-library source as training text: the files whose functions open code prompts (every
module outside the benchmark's, specc.prompts), and fixed modules cut into teacher-forced text windows."""
from __future__ import annotations

import importlib
import inspect
import sysconfig
from pathlib import Path

from ..prompts import STDLIB_MODULES

TRAIN_MODULES = ("argparse", "collections", "dataclasses", "datetime", "decimal", "email.message", "enum",
                 "functools", "gettext", "glob", "gzip", "http.cookies", "imaplib", "inspect", "locale", "logging",
                 "mailbox", "netrc", "operator", "optparse", "pprint", "queue", "random", "re", "sched", "selectors",
                 "shutil", "smtplib", "socketserver", "tarfile", "tempfile", "threading", "tokenize", "traceback",
                 "typing", "unittest.case", "urllib.parse", "uuid", "wave", "zipfile")


# Standard-library folders never used as training code (GUI, tests, bundled third-party code).
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
             "dist-packages", "__pycache__", "pydoc_data", "venv"}


def stdlib_sources() -> list[Path]:
    """The standard library's Python files, minus the benchmark's modules (specc.prompts) and SKIP_DIRS."""
    root = Path(sysconfig.get_paths()["stdlib"])
    bench = {root / (name.replace(".", "/") + ".py") for name in STDLIB_MODULES}
    bench |= {root / name.replace(".", "/") / "__init__.py" for name in STDLIB_MODULES}
    return [p for p in sorted(root.rglob("*.py"))
            if p not in bench and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]


def text_windows(tokenizer, n: int, seq_len: int, first: int = 0) -> list[list[int]]:
    """Windows first..first+n-1 of seq_len tokens from the training modules' source files, in order."""
    ids: list[int] = []
    for name in TRAIN_MODULES:
        try:
            ids += tokenizer(inspect.getsource(importlib.import_module(name)), add_special_tokens=False)["input_ids"]
        except (ImportError, OSError, TypeError):
            continue
        if len(ids) >= (first + n) * seq_len:
            break
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(first, min(first + n, len(ids) // seq_len))]
