"""Stage-by-stage progress for long commands (one tqdm bar, a line per finished stage)."""
from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm


class Stages:
    """`with stages.stage("lower target"):` advances one bar and logs how long each stage took."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.bar = tqdm(total=total, desc=desc, unit="stage", disable=not enabled, file=sys.stderr,
                        bar_format="{desc}: {n_fmt}/{total_fmt} stages |{bar:20}| {elapsed} {postfix}")
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        self.bar.set_postfix_str(name + " ...")
        start = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - start, 2)
        if not self.bar.disable:
            self.bar.write(f"  {name:<28} {self.timings[name]:7.1f}s", file=sys.stderr)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.set_postfix_str("done")
        self.bar.close()
