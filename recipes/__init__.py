"""fedkit's shipped recipes, installed as the package ``fedkit_recipes`` (YAML files)."""
