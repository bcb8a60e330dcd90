"""Recipes: typed YAML experiment descriptions (schema, loading with `extends:`, dotted overrides)."""

from omni_core.recipe.loader import (
    Locations,
    RecipeError,
    dump_recipe,
    flatten_recipe,
    load_located,
    load_recipe,
    located_problem,
    override_recipe,
)
from omni_core.recipe.schema import Recipe, recipe_hash

__all__ = [
    "Locations",
    "Recipe",
    "RecipeError",
    "dump_recipe",
    "flatten_recipe",
    "load_located",
    "load_recipe",
    "located_problem",
    "override_recipe",
    "recipe_hash",
]
