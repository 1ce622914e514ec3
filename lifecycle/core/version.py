"""The package version, in the core so every room can read it without importing up."""

__all__ = ["__version__"]

__version__ = "0.1.0"
