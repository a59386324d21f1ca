"""Recipes: the schema a recipe is validated into, and the recipes fedkit ships."""
