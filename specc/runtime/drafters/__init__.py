"""Drafters by the bundle's draft method. Each method's row in specc/methods.py names its drafter class;
adding a drafter is its module and that one row."""
from __future__ import annotations

import importlib

from ...errors import BundleError
from ...methods import METHODS, DraftMethod
from ..record import DraftPlan
from .base import DraftContext, Drafter, GraphDrafter, Proposal, with_method
from .front import FrontDrafter
from .lookup import PromptLookupDrafter


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
    front = "prompt_lookup" if ctx.settings.get("lookup") else "suffix" if ctx.settings.get("suffix") else None
    if front is not None:
        drafter = FrontDrafter(with_method(drafter_class(METHODS[front]).build(ctx), front), drafter)
    return drafter


__all__ = ["DraftContext", "DraftPlan", "Drafter", "FrontDrafter", "GraphDrafter", "PromptLookupDrafter", "Proposal",
           "build_drafter", "drafter_class"]
