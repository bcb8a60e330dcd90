"""Recipes: typed YAML experiment descriptions (schema, loading with `extends:`, dotted overrides)."""

from omni_core.recipe.loader import RecipeError, dump_recipe, flatten_recipe, load_recipe, recipe_hash
from omni_core.recipe.schema import Recipe

__all__ = ["Recipe", "RecipeError", "dump_recipe", "flatten_recipe", "load_recipe", "recipe_hash"]
