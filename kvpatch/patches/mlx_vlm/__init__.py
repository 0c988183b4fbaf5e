"""Patch units whose records are gated by the installed mlx-vlm release (CONTRIBUTING.md, "Layout")."""
