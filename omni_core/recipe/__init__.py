"""Recipes: typed YAML experiment descriptions (schema, loading with `extends:`, dotted overrides)."""

from omni_core.recipe.loader import RecipeError, dump_recipe, flatten_recipe, load_recipe, override_recipe
from omni_core.recipe.schema import Recipe, recipe_hash

__all__ = ["Recipe", "RecipeError", "dump_recipe", "flatten_recipe", "load_recipe", "override_recipe", "recipe_hash"]
