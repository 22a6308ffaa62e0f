"""The version, in one place: the package metadata (pyproject.toml reads it), `remat --version` and
the HTML report's footer."""

__version__ = "0.5.0"
