"""Errors that more than one layer raises or catches (a leaf module: no ember imports)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served by ember; the message names the reason."""


class EngineOverloadedError(RuntimeError):
    """A request refused for now (the host memory budget, a server that is shutting down): it
    may succeed later. The server answers 503 with Retry-After; it is not the client's error."""
