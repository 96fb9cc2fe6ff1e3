"""Errors that more than one layer raises or catches (a leaf module: no ember imports)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served by ember; the message names the reason."""
