"""Shared by tq-dequantize-dtype and hybrid-quant-dtype: quantized caches whose ``dequantize`` returns float32
whatever they were fed. The fix notes the dtypes fed to ``update_and_fetch`` and casts to them on the way out.
Not a patch unit (units live in the distribution folders).
"""

from __future__ import annotations

from typing import Any

#: Instance attribute holding ``(keys.dtype, values.dtype)`` of the last update.
DTYPES = "_kvpatch_kv_dtypes"


def noting(original: Any) -> Any:
    """``update_and_fetch`` that notes the dtypes of the keys and values fed (:data:`DTYPES`), then runs
    ``original``."""

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        self._kvpatch_kv_dtypes = (keys.dtype, values.dtype)
        return original(self, keys, values)

    return update_and_fetch
