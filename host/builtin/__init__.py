"""Built-in templates: recipes (recipes.py) and their host-side inputs (pydeps.py,
archives.py). The orchestrator builds them on first use (orchestrator/templates/builtin.py)."""
