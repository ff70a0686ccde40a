"""Early-exit adapters on disk: safetensors weights plus metadata naming the layer and model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

from .errors import ModelError
from .passes.add_early_exit import ExitAdapter


def save_adapter(path: str | Path, adapter: ExitAdapter, layer: int, info: dict) -> None:
    meta = {"format": "specc-exit-adapter", "layer": str(layer), "hidden": str(adapter.w1.in_features),
            "rank": str(adapter.w1.out_features), "eps": repr(adapter.eps), "info": json.dumps(info)}
    save_file({k: v.detach().contiguous() for k, v in adapter.state_dict().items()}, str(path), metadata=meta)


def adapter_metadata(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"exit adapter {path} does not exist; make one with `specc train-exit-head`")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises several types for unreadable files
        raise ModelError(f"exit adapter {path} is not a readable safetensors file: {exc}") from None
    if meta.get("format") != "specc-exit-adapter":
        raise ModelError(f"{path} is not a specc exit adapter (no specc-exit-adapter metadata)")
    return meta


def load_adapter(path: str | Path, layer: int, hidden: int) -> ExitAdapter:
    """The adapter at path, checked to be trained for this exit layer and hidden size."""
    meta = adapter_metadata(path)
    if int(meta["layer"]) != layer or int(meta["hidden"]) != hidden:
        raise ModelError(f"exit adapter {path} was trained for layer {meta['layer']} of a model with hidden size "
                         f"{meta['hidden']}, but the recipe asks for layer {layer} with hidden size {hidden}")
    adapter = ExitAdapter(hidden, int(meta["rank"]), float(meta["eps"]))
    adapter.load_state_dict(load_file(str(path)))
    return adapter.eval()
