"""Graph passes over step graphs, one per module, run in an explicit order built from the recipe."""
from __future__ import annotations

from ..methods import get_method
from ..recipe import Recipe
from .add_early_exit import AddEarlyExit
from .add_feature_outputs import AddFeatureOutputs
from .base import GraphPass, PassContractError, describe_contracts
from .insert_verify_head import InsertVerifyHead
from .replace_causal_mask import ReplaceCausalMask
from .restrict_draft_vocab import RestrictDraftVocab
from .truncate_to_exit import TruncateToExit


def build_pipeline(recipe: Recipe, role: str, hidden_size: int, head=None,
                   draft_vocab: list[int] | None = None) -> list[GraphPass]:
    """The ordered passes for one graph ("target" or "draft") of this recipe; `head`: the loaded Medusa or
    EAGLE head, whose `feature_layers` and `fc` (EAGLE-3) say which features the target returns; `draft_vocab`:
    the token ids a draft model's LM head keeps (draft.vocab)."""
    passes: list[GraphPass] = []
    if role == "draft" and draft_vocab is not None:
        passes.append(RestrictDraftVocab(draft_vocab))
    method = get_method(recipe.draft.method)
    if role == "draft" and method.graph == "exit":
        adapter = None
        if recipe.draft.adapter:
            from ..heads.exit import load_adapter

            adapter = load_adapter(recipe.draft.adapter, recipe.draft.layer, hidden_size)
        passes += [AddEarlyExit(recipe.draft.layer, adapter), TruncateToExit()]
    if role == "target" and method.reads_features:
        layers = getattr(head, "feature_layers", None)
        passes.append(AddFeatureOutputs(layers, head.fc.weight if layers else None))
    if recipe.speculation.mode == "tree" and (role == "target" or method.draft_attends):
        passes.append(ReplaceCausalMask())
    if role == "target" and recipe.speculation.verify_head:
        passes.append(InsertVerifyHead())
    return passes


def describe_passes() -> str:
    """Every pass with its contract, for `specc passes`."""
    return describe_contracts(ALL_PASSES)


ALL_PASSES: list[type[GraphPass]] = [RestrictDraftVocab, AddEarlyExit, TruncateToExit, AddFeatureOutputs, ReplaceCausalMask,
                                     InsertVerifyHead]

__all__ = ["ALL_PASSES", "GraphPass", "PassContractError", "build_pipeline", "describe_passes"]
