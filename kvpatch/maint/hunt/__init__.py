"""The bug hunt: kvpatch's invariants (:mod:`.invariants`) checked on upstream alone, with operation sequences that
Hypothesis generates and shrinks (:mod:`.machine`), fixed drives for lazy metadata (:mod:`.lazy`), and batched
against alone generation for every architecture a tiny config can be built for (:mod:`.models`). Each finding is a
self-contained reproduction (:mod:`.repro`), attributed by running it with kvpatch off, on, and on without each
candidate patch (:mod:`.attribute`). The command: ``python -m kvpatch.maint.hunt`` (:mod:`.cli`).

Maintainer tooling: needs hypothesis (the ``test`` dependency group), never imported by the runtime.
"""
