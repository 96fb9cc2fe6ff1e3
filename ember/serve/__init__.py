"""Serving: the async engine and the OpenAI-compatible HTTP server (`ember serve`)."""
