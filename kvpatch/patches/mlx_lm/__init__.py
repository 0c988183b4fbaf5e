"""Patch units whose records are gated by the installed mlx-lm release (CONTRIBUTING.md, "Layout")."""
