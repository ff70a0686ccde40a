"""Drafters by the bundle's draft method. Each method's row in specc/methods.py names its drafter class;
adding a drafter is its module and that one row."""
from __future__ import annotations

import importlib

from ...errors import BundleError
from ...methods import METHODS, DraftMethod
from .base import DraftContext, DraftInfo, DraftPlan, Drafter, GraphDrafter, Priced, Proposal, with_method
from .lookup import LookupFirstDrafter, PromptLookupDrafter


def drafter_class(method: DraftMethod) -> type[Drafter]:
    """The class a method's row names ("module:Class", imported here, or the class itself)."""
    if not isinstance(method.drafter, str):
        return method.drafter
    module, _, name = method.drafter.partition(":")
    return getattr(importlib.import_module(module), name)


def build_drafter(method: str, ctx: DraftContext) -> Drafter | None:
    """The drafter a bundle's draft method names (None for no drafting), with prompt lookup in front
    when the recipe asks for it (draft.lookup), or the suffix drafter (draft.suffix)."""
    row = METHODS.get(method)
    if row is None:
        raise BundleError(f"draft method {method!r} is not known to this specc; known: {', '.join(METHODS)}")
    if row.drafter is None:
        return None
    drafter = with_method(drafter_class(row).build(ctx), method)
    if ctx.settings.get("lookup"):
        drafter = LookupFirstDrafter(with_method(PromptLookupDrafter.build(ctx), "prompt_lookup"), drafter)
    elif ctx.settings.get("suffix"):
        from .suffix import SuffixDrafter, SuffixFirstDrafter

        drafter = SuffixFirstDrafter(with_method(SuffixDrafter.build(ctx), "suffix"), drafter)
    return drafter


__all__ = ["DraftContext", "DraftInfo", "DraftPlan", "Drafter", "GraphDrafter", "LookupFirstDrafter", "Priced",
           "PromptLookupDrafter", "Proposal", "build_drafter", "drafter_class"]
