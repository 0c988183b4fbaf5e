"""Shared by qsdpa-gqa-batch-mask (mlx-lm, A3) and vlm-qsdpa-batch-mask (mlx-vlm, V08): one bug, two copies.

Quantized attention reshapes grouped-query scores to 5-D ``(B, n_kv_heads, n_repeats, L, S)`` while a
4-D mask ``(B, 1 | n_q_heads, L, S)`` stays 4-D, so broadcasting lines the mask's batch axis up with
the KV-head axis. The replacement regroups the mask to 5-D first, then calls the original. Not a patch
unit (units live in the distribution folders).
"""

from __future__ import annotations

from typing import Any


def regrouping(original: Any) -> Any:
    """``original`` with its 4-D mask regrouped for grouped-query heads; the other arguments pass through as given."""

    def quantized_scaled_dot_product_attention(
        queries: Any, q_keys: Any, q_values: Any, scale: float, mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
            n_q_heads = queries.shape[1]
            n_kv_heads = q_keys[0].shape[-3]
            if n_q_heads != n_kv_heads:
                heads = mask.shape[1]
                if heads == 1:
                    mask = mask[:, :, None]
                elif heads == n_q_heads:
                    mask = mask.reshape(mask.shape[0], n_kv_heads, n_q_heads // n_kv_heads, *mask.shape[2:])
        return original(queries, q_keys, q_values, scale, mask, *args, **kwargs)

    return quantized_scaled_dot_product_attention
