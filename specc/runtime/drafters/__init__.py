"""Drafters by the bundle's draft method. Adding a kind: a module with a `Drafter` subclass and
one line in REGISTRY."""
from __future__ import annotations

from ...errors import BundleError
from .base import DraftContext, Drafter, GraphDrafter, Proposal
from .heads import EagleDrafter, MedusaDrafter
from .lookup import LookupFirstDrafter, PromptLookupDrafter
from .model import ModelDrafter, SharedCacheDrafter

REGISTRY: dict[str, type[Drafter]] = {
    "model": ModelDrafter,
    "quantized": ModelDrafter,
    "early_exit": SharedCacheDrafter,
    "prompt_lookup": PromptLookupDrafter,
    "medusa": MedusaDrafter,
    "eagle": EagleDrafter,
}


def build_drafter(method: str, ctx: DraftContext) -> Drafter | None:
    """The drafter a bundle's draft method names (None for 'none'), with prompt lookup in front
    when the recipe asks for it (draft.lookup)."""
    if method == "none":
        return None
    if method not in REGISTRY:
        raise BundleError(f"draft method {method!r} is not known to this specc; known: {', '.join(REGISTRY)}, none")
    drafter = REGISTRY[method].build(ctx)
    if ctx.settings.get("lookup"):
        drafter = LookupFirstDrafter(PromptLookupDrafter.build(ctx), drafter)
    return drafter


__all__ = ["REGISTRY", "DraftContext", "Drafter", "GraphDrafter", "EagleDrafter", "MedusaDrafter", "LookupFirstDrafter", "ModelDrafter", "PromptLookupDrafter",
           "Proposal", "SharedCacheDrafter", "build_drafter"]
