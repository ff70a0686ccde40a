"""A bundle's graphs opened with its backend and wrapped as step runners, and its tokenizer."""
from __future__ import annotations

from typing import Callable

import torch

from ..backends import LowerOptions, Runner, get_backend
from ..bundle import Bundle, check_code_trust
from ..capture.shapes import ModelDims
from ..errors import BundleError, SpeccError
from ..hardware import min_pass_rows_here
from .step import StepRunner


def load_graph(bundle: Bundle, role: str, open_graph: Callable[[Bundle, str], Runner], device: torch.device,
               min_rows: int = 1) -> StepRunner:
    """One graph of the bundle as a StepRunner; `open_graph` opens its engine (`open_runner`, or Triton's)."""
    entry = bundle.graph(role)
    if entry is None:
        raise BundleError(f"bundle {bundle.path} has no {role!r} graph")
    dims = ModelDims(**entry.model)
    return StepRunner(open_graph(bundle, role), dims, device, [i.name for i in entry.inputs], list(entry.outputs),
                      min_rows, vocab_ids(entry.facts.get("vocab_ids"), dims.vocab_size, f"{bundle.path}: {role}"))


def vocab_ids(runs, vocab_size: int, where: str) -> torch.Tensor | None:
    """The token ids of a graph's logits columns from the manifest's [first, last] runs (restrict_draft_vocab);
    None where the graph computes every token's logit. A BundleError for runs that are not ascending ids below
    the vocabulary size."""
    if runs is None:
        return None
    ok = isinstance(runs, list) and bool(runs) and all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(i, int) and not isinstance(i, bool) for i in r)
        and 0 <= r[0] <= r[1] < vocab_size for r in runs)
    ok = ok and all(a[1] < b[0] for a, b in zip(runs, runs[1:]))
    if not ok:
        raise BundleError(f"{where}: vocab_ids must be ascending [first, last] runs of token ids below {vocab_size}")
    return torch.cat([torch.arange(a, b + 1) for a, b in runs])


def min_target_pass_rows(bundle: Bundle) -> int | None:
    """The rows the target's 1-token passes are padded to on this CPU, so each row gets the bits a verify pass
    gives it (kernels are chosen per CPU at run time, hardware.min_pass_rows_here); None: no size is enough."""
    if bundle.manifest.backend != "onnxruntime":
        return 1
    return min_pass_rows_here(bundle.graph("target").facts.get("weight_quant"))


def open_runner(bundle: Bundle, role: str) -> Runner:
    """Open one graph of a bundle with the bundle's backend, in this process (versions and code trust checked).

    The bundle's files were checked by `open_bundle`; a loader that still fails (a file corrupted
    under --no-verify, an engine this machine cannot run) is a BundleError naming the graph."""
    m = bundle.manifest
    check_code_trust(bundle, get_backend(m.backend, check=False).runs_bundle_code)
    backend = get_backend(m.backend)
    backend.check_versions(m.versions)
    entry = bundle.graph(role)
    options = LowerOptions(m.recipe.precision, m.recipe.device, entry.quantize)
    where = f"the {role} graph of bundle {bundle.path} ({m.backend}, {entry.dir}/{entry.entry})"
    try:
        return CheckedRunner(backend.load(bundle.path / entry.dir, entry.to_dict(), options), where)
    except SpeccError:
        raise
    except Exception as exc:  # loaders raise their own types for unreadable engine files
        raise BundleError(f"{where} could not be loaded: {type(exc).__name__}: {str(exc)[:300]}. If it was opened "
                          "with --no-verify, a file may be corrupt: open it with verification") from None


class CheckedRunner:
    """A backend's runner whose failures are BundleErrors: an engine that rejects the inputs its
    manifest declares (a manifest that does not describe its engine) is a bad bundle, not a crash."""

    def __init__(self, runner: Runner, where: str):
        self.runner, self.where = runner, where
        self.output_names = runner.output_names

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        try:
            outputs = self.runner(*inputs)
        except SpeccError:
            raise
        except Exception as exc:  # the engine's own error types (onnxruntime, torch, TensorRT)
            raise BundleError(f"{self.where} failed on the inputs its manifest declares: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from None
        if len(outputs) != len(self.output_names):
            raise BundleError(f"{self.where} returned {len(outputs)} outputs; its manifest declares {self.output_names}")
        return outputs


def load_tokenizer(bundle: Bundle):
    """The bundle's tokenizer (its files were checked with the rest of the bundle)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(bundle.path / bundle.manifest.tokenizer.dir)
    except Exception as exc:  # transformers raises many types for unreadable tokenizer files
        raise BundleError(f"the tokenizer of bundle {bundle.path} could not be loaded: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from None
