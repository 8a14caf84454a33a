"""Package version (kept apart so that modules can record it without importing the package root)."""

__version__ = "0.1.0"
