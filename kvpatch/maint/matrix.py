"""The upstream release matrix: which mlx-lm / mlx-vlm releases kvpatch is tested against.

The one source of the matrix: ``tests/matrix.py`` re-exports it, :data:`TESTED` feeds COMPAT.md
(:mod:`kvpatch.maint.compat`) and :data:`SUPPORTED_FLOOR` the expiry rule (:mod:`kvpatch.maint.expiry`).

Each :class:`~kvpatch.maint.envs.Bucket` pairs one release under test with the mlx release it was
current with (newest mlx out on the day, at or above the release's own ``Requires-Dist: mlx>=``),
subject to it working on Linux CPU (``mlx[cpu]``, whose wheels start at 0.26.5), with few
distinct mlx layers. Build them with ``kvpatch.maint.envs.build_all(BUCKETS)``; run a test process
for one with ``kvpatch.maint.envs.bucket_environ(bucket)``.

Every bucket runs on one shared base interpreter that has :data:`BASE_REQUIREMENTS` installed
and none of mlx, mlx-cpu, mlx-lm, mlx-vlm. A bucket's ``extra`` layers hold dependencies whose
right version differs by bucket.
"""

from __future__ import annotations

from packaging.version import Version

from .envs import Bucket

__all__ = [
    "BASE_REQUIREMENTS",
    "BUCKETS",
    "BY_NAME",
    "LM_BUCKETS",
    "SUPPORTED_FLOOR",
    "TESTED",
    "VLM_BUCKETS",
]

#: What the shared base interpreter needs besides kvpatch and pytest, found by trying, in every
#: bucket below: ``import mlx.core, mlx_lm, mlx_lm.models.{cache,base,llama}, mlx_lm.generate``,
#: a forward pass of a tiny random llama with a prompt cache, ``mlx_lm.load`` + generate from a
#: local directory with a chat template, ``import mlx_vlm, mlx_vlm.models.{cache,base}``,
#: ``mlx_vlm.turboquant`` and a tiny random qwen2_vl language model with a KVCache.
#: Not needed for any of that, though mlx-lm / mlx-vlm declare them: sentencepiece, protobuf
#: (only to convert SentencePiece tokenizers of real checkpoints), opencv-python (only
#: mlx_vlm.models.multi_modality), mlx-audio (only mlx_vlm.models.inkling / nemotron_voicechat),
#: fastapi, uvicorn, starlette, python-multipart, websockets (servers), llguidance (structured
#: output), datasets, miniaudio, cryptography.
BASE_REQUIREMENTS: list[str] = [
    # mlx_lm and mlx_vlm import it at module level (mlx itself does not need it).
    "numpy>=1.26",
    # mlx_lm.utils / tokenizer_utils and mlx_vlm.utils import it; >=5.14 is what mlx-vlm >= 0.6.5
    # asks for, and every bucket with mlx-lm >= 0.30.2 works with 5.23. Buckets with older mlx-lm
    # layer 4.57.6 instead (see _TRANSFORMERS_4). It brings huggingface-hub, tokenizers,
    # safetensors, pyyaml, tqdm, regex.
    "transformers>=5.14,<6",
    # transformers' apply_chat_template raises ImportError without it (mlx_lm server / chat,
    # TokenizerWrapper with a chat template).
    "jinja2>=3.1",
    # `import mlx_vlm` fails without PIL (mlx_vlm.utils, image processors).
    "pillow>=10.3",
    # `import mlx_vlm` fails without it (mlx_vlm.utils); transformers 4.57 and huggingface-hub
    # 0.36 (the _TRANSFORMERS_4 layers) also import it.
    "requests>=2.31",
]

# transformers 5 made apply_chat_template return a BatchEncoding (return_dict=True by default);
# mlx-lm up to 0.28.4 predates transformers 5 and passes that result on as token ids (server,
# chat, generate/cache_prompt CLIs); 0.30.2 added TokenizerWrapper.apply_chat_template forcing
# return_dict=False. So buckets with older mlx-lm layer the last 4.x, with the huggingface-hub
# and tokenizers releases it accepts (transformers 4.57 checks both at import, and the base's
# are too new: hub 2.x, tokenizers 0.23.3).
_TRANSFORMERS_4 = ("transformers==4.57.6", "huggingface-hub==0.36.2", "tokenizers==0.22.2")


def _lm(version: str, mlx: str, extra: tuple[str, ...] = ()) -> Bucket:
    return Bucket(f"lm-{version}", (f"mlx[cpu]=={mlx}", f"mlx-lm=={version}"), extra)


def _vlm(version: str, mlx: str, mlx_lm: str, extra: tuple[str, ...] = ()) -> Bucket:
    return Bucket(f"vlm-{version}", (f"mlx[cpu]=={mlx}", f"mlx-lm=={mlx_lm}", f"mlx-vlm=={version}"), extra)


# mlx choice, per release (dates are wheel build dates; "needs" is its Requires-Dist):
#   lm 0.22.0-0.24.0 (Mar-Apr 2025, needs mlx>=0.22/0.25): 0.26.5, the oldest mlx with a Linux
#     CPU wheel (mlx-cpu starts at 0.26.5). Their mlx_lm.generate()/stream_generate() raise on
#     CPU with any mlx (wired_limit calls mx.metal.device_info() unconditionally); the model,
#     the caches, mlx_lm.load and generate_step work.
#   lm 0.28.0/0.28.1/0.28.4 (Sep-Dec 2025, needs >=0.29.1/0.29.2): 0.30.1, as 0.29.x was reported
#     to give NaNs on CPU (a tiny llama, fp32/fp16/bf16, 4-bit, up to 300 tokens, stayed finite
#     on 0.29.1 here); lm 0.30.2 (Jan 2026) was current with 0.30.1 too.
#   lm 0.30.4 (Jan 2026, needs >=0.30.3) and 0.30.7 (Feb 2026, needs >=0.30.4): 0.30.4.
#   lm 0.31.1 (Mar 2026) and 0.31.2 (Apr 2026): 0.31.1.  lm 0.31.3 (Apr 2026, needs >=0.31.2): 0.31.2.
#   lm 0.32.0 (Oct 2026, needs >=0.32.2): 0.32.3.  lm 0.32.2 (Oct 2026): 0.32.4.
LM_BUCKETS: tuple[Bucket, ...] = (
    _lm("0.22.0", "0.26.5", _TRANSFORMERS_4),
    _lm("0.23.2", "0.26.5", _TRANSFORMERS_4),
    _lm("0.24.0", "0.26.5", _TRANSFORMERS_4),
    _lm("0.28.0", "0.30.1", _TRANSFORMERS_4),
    _lm("0.28.1", "0.30.1", _TRANSFORMERS_4),
    _lm("0.28.4", "0.30.1", _TRANSFORMERS_4),
    _lm("0.30.2", "0.30.1"),
    _lm("0.30.4", "0.30.4"),
    _lm("0.30.7", "0.30.4"),
    _lm("0.31.1", "0.31.1"),
    _lm("0.31.2", "0.31.1"),
    _lm("0.31.3", "0.31.2"),
    _lm("0.32.0", "0.32.3"),
    _lm("0.32.2", "0.32.4"),
)

# mlx-vlm, with the newest mlx-lm out on its release day (0.31.3 from Apr to Oct 2026):
#   0.5.0-0.6.4 (May-Jul 2026, need mlx>=0.31.2, mlx-lm>=0.31.3): mlx 0.31.2, mlx-lm 0.31.3.
#     0.5.0-0.6.3 import mlx_lm on `import mlx_vlm`; from 0.6.4 only some model / tool-parser
#     modules do. 0.6.4 declares transformers<5.13 but imports every model package under 5.23.
#   0.6.5-0.6.16 (Jul-Aug 2026, need mlx>=0.32.0): mlx 0.32.0, mlx-lm 0.31.3 (0.6.14+ no longer
#     declare mlx-lm; mlx-lm 0.32.x was not out yet).
#   0.7.6 (Oct 2026, needs >=0.32.2) and 0.7.8 (needs >=0.32.3): mlx 0.32.3, mlx-lm 0.32.0.
#   0.7.10 (Oct 2026, needs >=0.32.4): mlx 0.32.4, mlx-lm 0.32.2.
# mlx_vlm.turboquant exists in every one of these (it first shipped in mlx-vlm 0.4.3).
VLM_BUCKETS: tuple[Bucket, ...] = (
    # 0.4.3: first release with mlx_vlm.turboquant (tq-dequantize-dtype's lower edge); 0.4.4: the
    # Metal-only kernel bugs' lower edge and the release before every batch cache class.
    _vlm("0.4.3", "0.31.2", "0.31.3"),
    _vlm("0.4.4", "0.31.2", "0.31.3"),
    _vlm("0.5.0", "0.31.2", "0.31.3"),
    _vlm("0.6.0", "0.31.2", "0.31.3"),
    _vlm("0.6.3", "0.31.2", "0.31.3"),
    _vlm("0.6.4", "0.31.2", "0.31.3"),
    _vlm("0.6.5", "0.32.0", "0.31.3"),
    _vlm("0.6.13", "0.32.0", "0.31.3"),
    _vlm("0.6.14", "0.32.0", "0.31.3"),
    _vlm("0.6.15", "0.32.0", "0.31.3"),
    _vlm("0.6.16", "0.32.0", "0.31.3"),
    _vlm("0.7.0", "0.32.3", "0.32.0"),  # tq-prefix-snapshot's lower edge
    _vlm("0.7.6", "0.32.3", "0.32.0"),
    _vlm("0.7.8", "0.32.3", "0.32.0"),
    _vlm("0.7.10", "0.32.4", "0.32.2"),
)

BUCKETS: tuple[Bucket, ...] = LM_BUCKETS + VLM_BUCKETS

BY_NAME: dict[str, Bucket] = {b.name: b for b in BUCKETS}

# Coexistence: downstream servers that carry their own monkey patches on the attributes kvpatch patches,
# with the mlx-lm / mlx-vlm releases their newest wheels pin (read from each wheel's METADATA):
#   vllm-mlx 0.6.0: mlx-lm>=0.31.3,<0.32.0 (so 0.31.3), mlx-vlm>=0.6.5 (pip picks the newest, 0.7.10,
#     which needs mlx>=0.32.4 and no longer imports mlx-lm), mlx>=0.29.0.
#   rapid-mlx 0.16.10: mlx-lm>=0.31.3,<0.32 (0.31.3), mlx-vlm==0.7.2 (needs mlx>=0.32.2), mlx>=0.32.1,<0.33.
# Both wheels ship a package named ``vllm_mlx`` (Rapid-MLX is a fork), so they cannot share a bucket.
# Not part of BUCKETS: tests/test_coexist.py runs tests/coexist in them when KVPATCH_COEXIST asks for it.
# What the servers' own test files import beyond the shared base (their FastAPI apps, JSON-schema
# validation of tool calls); without them 5 of vllm-mlx's and 13 of Rapid-MLX's overlapping test files do
# not even collect.
_COEXIST_EXTRA = (
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "h11==0.16.0",
    "opentelemetry-api==1.45.2",
    "python-multipart==0.0.34",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "attrs==26.1.0",
)
COEXIST_BUCKETS: tuple[Bucket, ...] = (
    Bucket(
        "coexist-vllm-mlx",
        ("mlx[cpu]==0.32.4", "mlx-lm==0.31.3", "mlx-vlm==0.7.10", "vllm-mlx==0.6.0"),
        _COEXIST_EXTRA,
    ),
    Bucket(
        "coexist-rapid-mlx",
        ("mlx[cpu]==0.32.4", "mlx-lm==0.31.3", "mlx-vlm==0.7.2", "rapid-mlx==0.16.10"),
        _COEXIST_EXTRA,
    ),
)

COEXIST_BY_NAME: dict[str, Bucket] = {b.name: b for b in COEXIST_BUCKETS}


def _releases(buckets: tuple[Bucket, ...], distribution: str) -> tuple[str, ...]:
    out = []
    for bucket in buckets:
        version = bucket.version(distribution)
        if version is None:  # pragma: no cover - every bucket pins its release under test
            raise ValueError(f"bucket {bucket.name} pins no {distribution} release")
        out.append(version)
    return tuple(out)


#: The releases under test, per distribution, in matrix order (COMPAT.md's release tables).
TESTED: dict[str, tuple[str, ...]] = {
    "mlx-lm": _releases(LM_BUCKETS, "mlx-lm"),
    "mlx-vlm": _releases(VLM_BUCKETS, "mlx-vlm"),
}

#: The oldest supported release of each distribution: the oldest release the matrix runs. Raising it
#: (dropping the oldest buckets) retires every patch fixed at or below the new floor.
SUPPORTED_FLOOR: dict[str, str] = {dist: min(releases, key=Version) for dist, releases in TESTED.items()}
