"""Does a kernel give a row the same bits whatever else its pass holds, on this machine?

Target-only decoding runs 1-token passes, a verify pass k+1 tokens; a kernel whose rows depend on the
pass size can flip a near-tied greedy choice, so speculative output would differ from the bundle's own
target-only output. The quantising passes probe the kernels they emit with this (compile records the
answer) and the runtime asks again where it runs (specc/hardware.py).
"""
from __future__ import annotations

import numpy as np


def rows_match_small_passes(model, x: np.ndarray, rows: int = 1, session_options=None) -> bool:
    """Does the ONNX `model` (input "x", output "y", rows on axis -2) give its first 2, 4, 6 and 9 rows of x the bits
    it gives each row alone in a pass of `rows` rows (the row and copies of it)?"""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), session_options, providers=["CPUExecutionProvider"])
    alone = [session.run(None, {"x": np.repeat(x[..., i:i + 1, :], rows, axis=-2)})[0][..., :1, :] for i in range(x.shape[-2])]
    single = np.concatenate(alone, axis=-2)
    return all(np.array_equal(session.run(None, {"x": x[..., :m, :]})[0], single[..., :m, :]) for m in (2, 4, 6, 9))
