"""How far rounding-sized errors in the keys and values a TurboQuant cache quantizes move the logits (a probe,
run by hand; the measurement behind ``kvpatch.testing.quantization_gap``).

``tests/upstream/test_empty_tq_rows.py`` decodes a batch merged from a prefilled and an empty
``BatchTurboQuantKVCache`` and compares each row's logits with the row decoded alone. This runs the same
comparison with the keys and values of the batched decode multiplied by ``1 + eps * N(0, 1)`` before they
reach the cache, for ``eps`` = 0 and the relative error sizes of TF32 matmuls (2^-13, 2^-11): TurboQuant maps
each rotated coordinate to a codebook entry, so an error that puts a coordinate across a midpoint moves it by
a code step. Inside a bucket with mlx-vlm 0.5.0 or newer::

    python scripts/in_bucket.py vlm-0.7.10 -- python -P scripts/probe_turboquant_flips.py

On the GPU, ``--no-perturb`` runs only the unperturbed comparison: under TF32 it differs by a code step where
a coordinate flips; with ``MLX_ENABLE_TF32=0`` it should be at rounding size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "upstream")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-perturb", action="store_true", help="only eps = 0")
    args = parser.parse_args(argv)

    import mlx.core as mx
    import test_empty_tq_rows as t
    from mlx_vlm.turboquant import BatchTurboQuantKVCache

    from kvpatch.testing import arithmetic, difference

    original = BatchTurboQuantKVCache.update_and_fetch
    state = {"eps": 0.0}

    def perturbed(self, keys, values):
        if state["eps"]:
            keys = keys * (1 + state["eps"] * mx.random.normal(keys.shape))
            values = values * (1 + state["eps"] * mx.random.normal(values.shape))
        return original(self, keys, values)

    BatchTurboQuantKVCache.update_and_fetch = perturbed
    print(f"device {mx.default_device()}, float32 matmuls as {arithmetic()}")
    for eps in (0.0,) if args.no_perturb else (0.0, 2.0**-13, 2.0**-11):
        for order in ("full.extend(empty)", "empty.extend(full)"):
            for bits in (4, 3.5):
                mx.random.seed(1)
                model = t.tiny_pixtral_language_model(head_dim=32, heads=4, kv_heads=2)
                full, empty = t._caches(model, bits, t.PROMPT), t._caches(model, bits, None)
                merged, other = (full, empty) if order[0] == "f" else (empty, full)
                for a, b in zip(merged, other, strict=True):
                    a.extend(b)
                p_full, p_empty = (0, 1) if order[0] == "f" else (1, 0)
                state["eps"] = eps  # only the batched decode sees the perturbation
                batched = t._decode(model, merged, t.STEPS)
                state["eps"] = 0.0
                full_row = difference(batched[p_full], t._alone(model, bits, t.PROMPT, p_full))
                empty_row = difference(batched[p_empty], t._alone(model, bits, None, p_empty))
                print(f"eps {eps:<10.3g} {order:<19} {bits:>3} bits: full row {full_row}, empty row {empty_row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
