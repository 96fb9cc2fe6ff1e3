"""Attention backends and the paged-attention custom op."""
