"""The CPU kernel settings the precision sweep and the kernel benchmark run under, one list for both.

oneDNN (``ONEDNN_MAX_CPU_ISA``: the bf16 matrix products) and ATen (``ATEN_CPU_CAPABILITY``: the
vectorised element-wise kernels, SDPA's CPU kernel) choose their kernels when torch starts, so each
setting needs a fresh process with its own environment (:func:`environ`).
"""

from __future__ import annotations

import os

KEYS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
SETTINGS = [
    {},
    {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},       # an AVX2-only machine, both libraries
    {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default"},    # the two narrowest together
]


def label(env: dict) -> str:
    """``KEY=VALUE, ...``, or ``machine defaults`` for the empty setting."""
    return ", ".join(f"{k}={v}" for k, v in env.items()) or "machine defaults"


def file_stem(text: str) -> str:
    """A file name for a label."""
    return text.replace(", ", "_").replace("=", "-").replace(" ", "-")


def environ(env: dict, **extra: str) -> dict:
    """This process's environment with the kernel variables replaced by ``env``, plus ``extra``."""
    e = {k: v for k, v in os.environ.items() if k not in KEYS}
    e.update(env)
    e.update(extra)
    return e
