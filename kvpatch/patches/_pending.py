"""Right padding that ``prepare()`` declares and ``finalize()`` applies later: keeping it filtered (vlm- and
lm-filter-right-padding, V10 / L-V10, and the extract units) and the ``prepare`` that batch caches without one get
(batch-quantized-prepare, tq-batch-prepare). Not a patch unit (units live in the distribution folders)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def filter_pending(attribute: str) -> Any:
    """A builder: ``filter`` that also keeps only the kept rows of the padding pending in ``attribute``.

    ``prepare()`` declares right padding (``_right_padding`` or ``_lengths``) that ``finalize()`` applies
    later; upstream's ``filter`` leaves it unfiltered, so finalize then pads rows that are gone.
    """

    def build(original: Any) -> Any:
        def filter(self: Any, batch_indices: Any) -> Any:
            pending = getattr(self, attribute, None)
            result = original(self, batch_indices)
            if pending is not None:
                setattr(self, attribute, pending[batch_indices])
            return result

        return filter

    return build


def prepare(refresh: Callable[[Any], None] | None = None) -> Any:
    """The ``prepare`` a batch cache lacks, with ``BatchKVCache.prepare``'s contract: left padding goes into an
    empty cache at once (then ``refresh(self)``), right padding waits in ``_right_padding`` for ``finalize``."""
    import mlx.core as mx

    def prepare(self: Any, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        """Batch padding before a prefill (``BatchKVCache.prepare``'s contract; added by kvpatch)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(f"Left padding can only be added to an empty {type(self).__name__}")
            left_padding = mx.array(left_padding)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
            if refresh is not None:
                refresh(self)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    return prepare
