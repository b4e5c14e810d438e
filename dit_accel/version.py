"""The package's version (pyproject.toml's), importable from every layer without the package root's API."""
__version__ = "0.1.0"
