"""`--init target`: an EAGLE head that starts as the target's last decoder layer instead of random weights."""
from __future__ import annotations

import torch

from ..capture.families import family_for
from ..errors import SpeccError
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head

INITS = ("random", "target")


def start_from_target(head: EagleHead | Eagle3Head, target) -> None:
    """`--init target`: the head's decoder layer starts as the target's last one (attention, post-attention
    norm, MLP) and fc as [0 | I] without bias, passing the feature through: pretrained weights for a head
    trained on little data. Requires a layer of the head's names and shapes and norms without an offset.
    EAGLE-3 (`_start_eagle3`): the same layer over the highest fused layer's output."""
    if family_for(target.config).norm_offset:
        raise SpeccError(f"--init target: {target.config.model_type} norms scale by (1 + w), the head's by w; "
                         "allowed here: --init random")
    last = target.model.layers[-1].state_dict()
    if isinstance(head, Eagle3Head):
        _start_eagle3(head, last)
        return
    mine = head.layers[0].state_dict()
    missing = [k for k in mine if k not in last or last[k].shape != mine[k].shape]
    if missing:
        raise SpeccError(f"--init target: the target's last layer has no {', '.join(missing)} of the head's shape; "
                         "allowed here: --init random")
    head.layers[0].load_state_dict({k: last[k] for k in mine})
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, head.hidden:] = torch.eye(head.hidden)
        if head.fc.bias is not None:
            head.fc.bias.zero_()


def _start_eagle3(head: Eagle3Head, last: dict[str, torch.Tensor]) -> None:
    """EAGLE-3's midlayer as the target's last layer reading the fused feature: hidden_norm is that layer's
    input norm, q/k/v its projections on the feature's half of the [embedding; feature] input (zero on the
    embedding's half), and fc passes the highest fused layer's output through, so the head starts as the
    target's last layer applied to that layer's output (the residual stream a decoder layer reads)."""
    mine, new = head.midlayer.state_dict(), {}
    for name, value in mine.items():
        if name.startswith("input_layernorm."):  # the embedding's norm: the target has none to copy
            continue
        source = last.get(name.replace("hidden_norm.", "input_layernorm."))
        if source is not None and name.split(".")[1] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
            source = torch.cat([torch.zeros_like(source), source], 1)
        if source is None or source.shape != value.shape:
            raise SpeccError(f"--init target: the target's last layer has no {name} of the EAGLE-3 head's shape; "
                             "allowed here: --init random")
        new[name] = source
    head.midlayer.load_state_dict(new, strict=False)
    high = max(range(len(head.feature_layers)), key=lambda i: head.feature_layers[i])
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, high * head.hidden:(high + 1) * head.hidden] = torch.eye(head.hidden)
