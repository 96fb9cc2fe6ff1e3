"""ember's version, a leaf module: the compile-cache key reads it without importing the package."""

__version__ = "0.1.0"
