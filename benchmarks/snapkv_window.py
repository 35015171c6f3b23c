"""SnapKV's observation window decides the query-aware verdicts: SnapKV at kvpress's window (the
last 64 queries, the default ``snapkv``) beside the same score read from the last 16 and 32.

Policies of one's own, one small class each, run by ``attngeom kvtasks`` from this file (no edit
of attngeom; docs/kvcache.md, "A policy of your own")::

    OMP_NUM_THREADS=1 attngeom kvtasks --model smollm2-135m --length 2048 --examples 5 \\
        --mode query-aware --tasks niah_single,niah_multikey --ratios 0.25,0.5 \\
        --policies snapkv,benchmarks/snapkv_window.py:SnapKV32,benchmarks/snapkv_window.py:SnapKV16 \\
        --out out/snapkv-window
    python tools/kvtasks_tables.py out/snapkv-window

Each class is kvpress's SnapKV (the window's attention summed, average-pooled over 5 entries with
the window cut off, the window kept) with another window; only the window differs.
"""

from __future__ import annotations

from attngeom.kvcache.policies import Policy, snapkv


class _Window(Policy):
    """kvpress's SnapKV read from the last ``last`` queries instead of 64."""

    needs, accumulate, prefill_only = "attention", False, True

    def priority(self, ctx):
        return snapkv(window=self.last).priority(ctx)


class SnapKV32(_Window):
    """SnapKV with the last 32 queries as its window (kvpress: 64)."""

    name, last = "snapkv_w32", 32


class SnapKV16(_Window):
    """SnapKV with the last 16 queries as its window."""

    name, last = "snapkv_w16", 16
