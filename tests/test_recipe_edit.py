"""Recipe fields set in place (what `specc tune --write` does): layout and comments kept, every edit validated."""
from __future__ import annotations

import pytest
import yaml

from specc.errors import SpeccError
from specc.recipe_edit import _edit_field, set_recipe_fields


@pytest.mark.parametrize("before, after", [
    ("speculation:\n  mode: chain\n  k: 3  # per round\nbackend: torch\n", "speculation:\n  mode: chain\n  k: 6  # per round\nbackend: torch\n"),
    ("speculation: {mode: chain, k: 4}  # flow\n", "speculation: {mode: chain, k: 6}  # flow\n"),
    ("speculation: {mode: chain}\n", "speculation: {mode: chain, k: 6}\n"),
    ("speculation:\n    mode: chain\n# note\nbackend: torch\n", "speculation:\n    k: 6\n    mode: chain\n# note\nbackend: torch\n"),
    ("backend: torch\n", "backend: torch\nspeculation:\n  k: 6\n"),
])
def test_edit_k_keeps_layout(before, after):
    assert _edit_field("target: {model: m}\n" + before, "speculation", "k", 6) == "target: {model: m}\n" + after


def test_set_recipe_fields_validates(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: {model: m}\ndraft: {method: prompt_lookup}\nspeculation: {k: 2}\n")
    assert set_recipe_fields(recipe, {("speculation", "k"): 5}) == {("speculation", "k"): 2}
    assert yaml.safe_load(recipe.read_text())["speculation"]["k"] == 5
    with pytest.raises(SpeccError, match="above the maximum 16"):
        set_recipe_fields(recipe, {("speculation", "k"): 17})
    with pytest.raises(SpeccError, match="draft.stop_below"):  # prompt lookup has no chains to stop
        set_recipe_fields(recipe, {("draft", "stop_below"): 0.5})
    assert yaml.safe_load(recipe.read_text())["speculation"]["k"] == 5  # a refused edit writes nothing


def test_set_recipe_fields_edits_k_and_stop_below_in_one_go(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: {model: m}\ndraft:\n  method: model   # the small one\n  model: d\n"
                      "  stop_below: 0.5  # ends chains\nspeculation: {mode: chain, k: 4}\n")
    old = set_recipe_fields(recipe, {("speculation", "k"): 3, ("draft", "stop_below"): 0.7})
    assert old == {("speculation", "k"): 4, ("draft", "stop_below"): 0.5}
    text = recipe.read_text()
    assert "# the small one" in text and "  stop_below: 0.7  # ends chains" in text
    assert yaml.safe_load(text)["speculation"] == {"mode": "chain", "k": 3}
