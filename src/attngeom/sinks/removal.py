"""Attention sinks (SPEC §4): sink-norm removal and its control, as an intervention that records
the head outputs it leaves.

Sink-norm removal, its control and the cone measure ``κ`` are defined in SPEC §4 (docs/SPEC.md);
:class:`SourceRemoval` edits the weights that mix the values (no renormalisation, SPEC §3) and
records the output norm, ``κ`` (column ``cone``) and ``cos(o_i, m_i)`` (``cos_output_semantic``)
of the outputs it leaves.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from attngeom.metrics import formulas as metrics
from attngeom.capture.blocks import Block
from attngeom.capture.interventions import SOURCE_REMOVALS, remove_source
from attngeom.sinks.geometry import intra_dot
from attngeom.streaming.reducers import Reducer, add_into

# --------------------------------------------------------------------------------------------
# Removal
# --------------------------------------------------------------------------------------------

REMOVAL_MODES = ("none", *SOURCE_REMOVALS)


class SourceRemoval(Reducer):
    """Intervention that removes the sink (``mode="sink"``) or the mass-matched control source
    (``mode="control"``) from every query ``i > sink`` of ``layers`` (None: all observed layers), and
    records, for every observed layer, the head outputs that are actually used.

    With ``mode="none"`` nothing is edited: the same statistics describe the unedited model, so a
    baseline pass and a removal pass are measured by the same code. ``min_query`` (default
    ``sink + 1``) is the first query position edited. Queries whose sink rate (in the pass's own,
    unedited attention) is at least ``heavy`` are also summarised apart (``*_sink_heavy``): these
    are the low-norm outputs the paper says collapse into the semantic cone."""

    def __init__(self, mode: str = "sink", sink: int = 0, layers=None, min_query: int | None = None,
                 heavy: float = 0.5):
        if mode not in REMOVAL_MODES:
            raise ValueError(f"mode must be one of {REMOVAL_MODES}, got {mode!r}")
        self.mode = mode
        self.sink = int(sink)
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.min_query = self.sink + 1 if min_query is None else int(min_query)
        self.heavy = float(heavy)
        self.acc: dict[int, dict[str, torch.Tensor]] = {}
        self.calls = 0

    STATE = ("acc", "calls")

    def edits(self, layer: int) -> bool:
        return self.mode != "none" and (self.layers is None or layer in self.layers)

    def _add(self, layer: int, key: str, x: torch.Tensor) -> None:
        add_into(self.acc.setdefault(layer, {}), key, x)

    def __call__(self, block: Block) -> torch.Tensor | None:
        self.calls += 1
        B, H, Q, S = block.shape
        a = block.a
        st = block.state
        sink_col = self.sink - block.k_start
        sink_col = sink_col if 0 <= sink_col < S else None
        qsel = block.query_valid & (block.q_positions[None, :] >= self.min_query)       # [B,Q]
        edited = None
        removed = torch.zeros(B, H, Q, device=a.device)
        if self.edits(block.layer):
            edited, removed = remove_source(a, block.visible, sink_col, qsel, self.mode, removed)
        # statistics of the outputs actually used (queries i > sink)
        w = (block.query_valid & (block.q_positions[None, :] > self.sink)).double()     # [B,Q]
        if block.q_start + Q > self.sink + 1:       # a query after the sink (decided without reading the block)
            mix = a if edited is None else edited
            G = st.G
            u = mix @ block.v                                                        # [B,H,Q,d]
            on = metrics.head_output_norm(u, G)
            a_tail = a.clone()
            if sink_col is not None:
                a_tail[..., sink_col] = 0.0
            m = a_tail @ block.v
            mn = metrics.head_output_norm(m, G)
            cos_om = metrics.safe_div(((u @ G) * m).sum(-1), on * mn)
            # cone measure κ: attention-weighted mean cosine of o with the non-sink values
            dots = intra_dot(u, block.v, G)                                         # [B,H,Q,S]
            vn = block.value_norm.unsqueeze(-2)
            cos = metrics.safe_div(dots, on.unsqueeze(-1) * vn)
            kappa = metrics.safe_div((a_tail * cos).sum(-1), a_tail.sum(-1))
            o_norm = (metrics.pulled_back(u, st.G_full) * u).sum((1, -1)).clamp_min(0).sqrt()  # ‖o_i‖ [B,Q]
            wd = w[:, None, :].expand(B, H, Q)
            L = block.layer
            self._add(L, "n", wd.sum((0, 2)))
            self._add(L, "output_norm", (on.double() * wd).sum((0, 2)))
            self._add(L, "log_output_norm", (torch.log(on.double().clamp_min(1e-30)) * wd).sum((0, 2)))
            self._add(L, "cone", (kappa.double() * wd).sum((0, 2)))
            self._add(L, "cos_output_semantic", (cos_om.double() * wd).sum((0, 2)))
            self._add(L, "removed_mass", (removed.double() * wd).sum((0, 2)))
            rho = a[..., sink_col] if sink_col is not None else torch.zeros_like(on)
            heavy = wd * (rho >= self.heavy).double()
            self._add(L, "heavy_n", heavy.sum((0, 2)))
            self._add(L, "heavy_output_norm", (on.double() * heavy).sum((0, 2)))
            self._add(L, "heavy_cone", (kappa.double() * heavy).sum((0, 2)))
            self._add(L, "layer_n", w.sum().reshape(1))
            self._add(L, "layer_output_norm", (o_norm.double() * w).sum().reshape(1))
        return edited

    def result(self) -> pd.DataFrame:
        """One row per (layer, head): mean ``output_norm``, ``log_output_norm``, ``cone``,
        ``cos_output_semantic``, ``removed_mass``, the same means of ``output_norm`` and ``cone``
        over sink-heavy queries (``*_sink_heavy``, with their count), and the layer's mean
        ``layer_output_norm``."""
        rows = []
        for layer in sorted(self.acc):
            A = {k: x.cpu().numpy() for k, x in self.acc[layer].items()}
            if not A["n"].any():                  # no query after the sink in this layer
                continue
            H = len(A["n"])
            lo = A["layer_output_norm"][0] / A["layer_n"][0] if A["layer_n"][0] else np.nan
            for h in range(H):
                n = A["n"][h]
                row = {"mode": self.mode, "layer": layer, "head": h, "queries": int(n),
                       "edited": self.edits(layer)}
                for k in ("output_norm", "log_output_norm", "cone", "cos_output_semantic", "removed_mass"):
                    row[k] = A[k][h] / n if n else np.nan
                hn = A["heavy_n"][h]
                row["queries_sink_heavy"] = int(hn)
                row["output_norm_sink_heavy"] = A["heavy_output_norm"][h] / hn if hn else np.nan
                row["cone_sink_heavy"] = A["heavy_cone"][h] / hn if hn else np.nan
                row["layer_output_norm"] = lo
                rows.append(row)
        return pd.DataFrame(rows)
