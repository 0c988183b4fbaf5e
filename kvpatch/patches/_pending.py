"""Shared by vlm-filter-right-padding (V10) and lm-filter-right-padding (L-V10): one bug in mlx-vlm's and
mlx-lm's copies of the batch caches. Not a patch unit (units live in the distribution folders)."""

from __future__ import annotations

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
