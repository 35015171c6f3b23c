"""Fused routes: the statistics of the streaming summaries without any ``[B, H, Q, S]`` block
(SPEC §10).

The block path (:func:`attngeom.capture.kernel.exact_attention`) writes every block of attention
weights and passes over it. Most of what :class:`~attngeom.streaming.reducers.HeadStats` and
:class:`~attngeom.streaming.reducers.TokenStats` need is already computed by fused attention kernels
that never form ``T x T``:

- a *per-query* quantity is read from the attention's output ``Σ_j a_ij x_j`` with the right values
  ``x`` and from the row's log-sum-exp ``lse_i``: head outputs (``x = v``), the entropy
  (``x = k``: ``H_i = lse_i − scale·q_i·Σ_j a_ij k_j``), one column ``a_is = exp(s_is − lse_i)``
  (sink rate, sink contributions), the diagonal ``a_ii`` (self-attention);
- a *per-source* total ``Σ_i a_ij ⟨f_i, g_j⟩`` is ``⟨g_j, (PᵀF)_j⟩``, and ``PᵀF`` is the gradient
  of the values that the attention's backward computes for the output gradient ``F``: what a token
  receives by attention, value-weighted, output-normalised and by contribution, several signals as
  the columns of one ``F``;
- the row-wise source winner ``argmax_j a_ij n_j`` (SPEC §6) does not depend on ``lse_i``: it is
  ``argmax_j (s_ij + log n_j)``, one pass over the keys in
  :func:`attngeom.capture.fused_winner.source_winner` (a Triton kernel on CUDA).

:func:`unsupported` says why a layer's attention cannot be reproduced by the fused kernels (the
layer then takes the block path, and the run records why); :class:`FusedLayer` is one layer's
statistics on that route, computed on first use like a block's. Learned sink logits (gpt-oss) are
exact here: the sink rescales each row by ``γ_i = 1 − a_i∅``, so outputs and ``PᵀF`` of the real
tokens are those of the sink-free attention times ``γ_i``.

Kernels: on the CPU ATen's fused flash attention for the CPU (forward with ``lse``, and its
backward); on CUDA the memory-efficient kernel (float32, bf16, fp16). Shapes: ``B`` batch, ``H``
query heads, ``T`` queries (= sources: the route serves calls without cached keys), ``d`` widths.
"""

from __future__ import annotations

from functools import cached_property
from typing import Iterable

import torch

from attngeom.errors import InputError
from attngeom.metrics import formulas as metrics

ROUTES = ("auto", "fused", "block")
"""The routes a user may ask for: ``auto`` (per device, :func:`auto_fused`), ``fused`` (the fused
route wherever it is exact, the block path elsewhere, said in the record), ``block`` (always blocks)."""

FUSED_DEVICES = ("cpu", "cuda")

WHOLE_MASK_ROUTE = "fused: the whole [T, T] mask (neither causal nor a sliding window with right padding: memory quadratic in T)"
"""The route recorded for a fused layer whose mask is neither causal with right padding nor a
sliding window over such: left padding, a bidirectional or a custom mask. The kernels then take the
mask whole as a float ``[B, 1, T, T]`` tensor, exact but quadratic in memory (SPEC §10)."""

FUSED_RECEIVED = ("attention", "value_weighted", "output_normalized", "contribution")
"""The token-level scores whose sums over queries :meth:`FusedLayer.received` computes (SPEC §2's)."""


def check_route(route: str) -> str:
    """``route`` if it is one of :data:`ROUTES`; an :class:`~attngeom.errors.InputError` naming them
    otherwise (one line)."""
    if route not in ROUTES:
        raise InputError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


def auto_fused(device: torch.device) -> bool:
    """Whether ``route="auto"`` takes the fused route on ``device``: on accelerators (where the block
    path costs 18-115x the SDPA forward, docs/benchmark-analyze.md); on the CPU the block path stays
    the default (it costs 1.3-2.3x the forward there, and the fused backward is not measured faster
    at 2k)."""
    return torch.device(device).type == "cuda"


def unsupported(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                softcap: float | None) -> str | None:
    """Why the fused kernels cannot reproduce this attention call exactly (None: they can).

    ``query [B, H, Tq, dk]``, ``key [B, Hkv, S, dk]``, ``mask`` the call's boolean SDPA mask or None
    (causal). Grouped queries, padding and sliding windows (both in the boolean mask), learned sinks
    and a value width other than the query's (multi-head latent attention) are served."""
    if softcap is not None:
        return "soft-capping (the fused kernels have no score_mod)"
    if query.shape[2] != key.shape[2]:
        return "a call with cached keys (a decoding step)"
    if mask is not None and mask.dtype != torch.bool:
        return "an additive float mask"
    device = query.device.type
    if device not in FUSED_DEVICES:
        return f"no fused attention kernel with log-sum-exp on {device}"
    if device == "cuda" and query.dtype == torch.float64:
        return "float64 on CUDA (the fused kernels take float32, bf16, fp16)"
    return None


# --------------------------------------------------------------------------------------------
# The two kernel calls: attention with its log-sum-exp, and the values' gradient PᵀF
# --------------------------------------------------------------------------------------------


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` padded with zeros to ``width`` along the last dimension (zeros add nothing to ``q·k``)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _width(*xs: torch.Tensor) -> int:
    """The common head width the kernels are given: the widest, rounded up to a multiple of 8
    (the memory-efficient kernel's alignment)."""
    return -(-max(x.shape[-1] for x in xs) // 8) * 8


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The boolean mask as the kernels take it (0 visible, −inf hidden, ``dtype``), every row with
    at least one visible source: a row that sees nothing (a padded query) is let see everything, so
    that no kernel divides by zero (its weight in every statistic is 0). On CUDA the last dimension's
    stride is a multiple of 16 (the memory-efficient kernel's alignment of its bias)."""
    if mask is None:
        return None
    empty = ~mask.any(-1, keepdim=True)
    seen = mask | empty
    T = seen.shape[-1]
    pad = 0 if mask.device.type == "cpu" else -T % 16
    out = torch.zeros(*seen.shape[:-1], T + pad, dtype=dtype, device=mask.device)[..., :T]
    return out.masked_fill_(~seen, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, scale: float,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(Σ_j a_ij x_j [B, H, T, m], lse_i [B, H, T], saved)`` of ``a = softmax(scale·q kᵀ + mask)``,
    one fused call; ``saved``: what :func:`transpose` hands the backward. ``q, k [B, H, T, dk]`` (one
    key per query head), ``x [B, H, T, m]``, ``mask`` additive (:func:`additive_mask`) or None (causal)."""
    width = _width(q, x)
    q, k, xp = _pad_last(q, width), _pad_last(k, width), _pad_last(x, width)
    causal = mask is None
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, xp, 0.0, causal, attn_mask=mask, scale=scale)
        saved = (lse,)
    else:
        bias = None if mask is None else mask.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse_p, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, xp, bias, True, 0.0, causal, scale=scale)
        lse, saved = lse_p[..., :q.shape[2]], (lse_p, seed, offset)
    return out[..., :x.shape[-1]], lse, saved


def transpose(q: torch.Tensor, k: torch.Tensor, saved: tuple, F: torch.Tensor, scale: float,
              mask: torch.Tensor | None) -> torch.Tensor:
    """``PᵀF`` per head, ``[B, H, T, m]``: the gradient of the values that the attention's backward
    computes for the output gradient ``F [B, H, T, m]`` (``dV = Pᵀ dO`` does not depend on the
    values, so zeros are passed; the gradients of ``q`` and ``k`` are not used). ``saved``: from
    :func:`attend` of the same ``q``, ``k`` and ``mask``."""
    width = _width(q, F)
    q, k, Fp = _pad_last(q, width), _pad_last(k, width), _pad_last(F, width).contiguous()
    zeros = torch.zeros_like(Fp)                                                    # the output
    values = zeros if k.shape[2] == q.shape[2] else Fp.new_zeros(*k.shape[:-1], width)
    causal = mask is None
    if q.device.type == "cpu":
        dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            Fp, q, k, values, zeros, saved[0], 0.0, causal, attn_mask=mask, scale=scale)[2]
    else:
        bias = None if mask is None else mask.expand(q.shape[0], q.shape[1], -1, -1)
        lse_p, seed, offset = saved
        dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            Fp, q, k, values, bias, zeros, lse_p, seed, offset, 0.0, [False, False, True, False], causal,
            scale=scale)[2]
    return dv[..., :F.shape[-1]]


# --------------------------------------------------------------------------------------------
# The source winner (SPEC §6), row-wise: argmax_j a_ij n_j = argmax_j (s_ij + log n_j)
# --------------------------------------------------------------------------------------------


def source_winner_masked(q: torch.Tensor, k: torch.Tensor, v_norm: torch.Tensor, *, scale: float,
                         mask: torch.Tensor, block_queries: int = 256) -> torch.Tensor:
    """The source winner ``argmax_j a_ij n_j`` of every query under any boolean ``mask``
    (``[B|1, 1, Q, S]``, True = visible): ``[B, H, Q]`` long, ties to the earliest source as
    ``argmax`` breaks them. ``q [B, H, Q, d]``, ``k [B, H, S, d]``, ``v_norm [B, H, S]``. In blocks of
    ``block_queries`` queries: the fallback of :func:`attngeom.capture.fused_winner.source_winner`
    (causal, windows and right padding only) for masks it cannot describe."""
    B, H, Q, _ = q.shape
    index = torch.empty(B, H, Q, dtype=torch.long, device=q.device)
    log_n = v_norm.log()[:, :, None, :]
    for i0 in range(0, Q, block_queries):
        i1 = min(Q, i0 + block_queries)
        s = (q[:, :, i0:i1] @ k.transpose(-1, -2)) * scale
        index[:, :, i0:i1] = (s + log_n).masked_fill(~mask[:, :, i0:i1], float("-inf")).argmax(-1)
    return index


def describes(mask: torch.Tensor, window: int | None, lengths: torch.Tensor,
              block_queries: int = 1024) -> bool:
    """Whether the boolean ``mask [B|1, 1, T, T]`` is exactly causal, with the sliding ``window``
    (``j > i − window``) and the right padding of ``lengths`` (``j < lengths[b]``): what the fused
    winner kernel takes."""
    T = mask.shape[-1]
    cols = torch.arange(T, device=mask.device)
    real = cols[None, :] < lengths.to(mask.device)[:, None]                           # [B', T]
    for i0 in range(0, T, block_queries):
        rows = torch.arange(i0, min(T, i0 + block_queries), device=mask.device)[:, None]
        want = cols[None, :] <= rows
        if window is not None:
            want = want & (cols[None, :] > rows - window)
        want = want[None] & real[:, None, :]
        if not torch.equal(mask[:, 0, i0:i0 + block_queries].expand_as(want), want):
            return False
    return True


# --------------------------------------------------------------------------------------------
# One layer's statistics on the fused route
# --------------------------------------------------------------------------------------------


class FusedLayer:
    """One attention layer's statistics without blocks: each computed on first use and kept.

    ``q [B, H, T, dk]``, ``k [B, Hkv, T, dk]``, ``value [B, Hkv, T, dv]`` as the call received them:
    the kernels run in their dtype (bf16, fp16; float32 otherwise, float64 kept) and accumulate in
    float32, the statistics are float32 (float64 for float64 inputs); ``mask``: the call's boolean mask or None (causal);
    ``sinks [H]``: learned sink logits or None; ``window``: the call's sliding window (the source
    winner's kernel takes it when the mask is exactly causal with it); ``G [H, dv, dv]``, ``G_full [H*dv, H*dv]``: the output
    projection's Gram matrices (SPEC §2); ``lengths [B]``: real tokens per row (right padding).
    Every per-query quantity is ``[B, H, T]`` (``[B, T]`` on the layer), every per-source total
    ``[B, T]``: the same numbers the block path's :class:`~attngeom.capture.blocks.Block` gives for
    all its queries at once."""

    k_start = 0
    q_start = 0

    def __init__(self, q, k, value, scale: float, mask: torch.Tensor | None, G: torch.Tensor,
                 G_full: torch.Tensor, lengths: torch.Tensor, sinks: torch.Tensor | None = None,
                 layer: int = 0, window: int | None = None):
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        H, Hkv = q.shape[1], k.shape[1]
        self.layer, self.window = layer, window
        self.n_rep = H // Hkv
        # the kernels run in the call's dtype (bf16 and fp16 on tensor cores), the statistics in float32
        self.kernel_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else dtype
        self.kq = q.to(self.kernel_dtype)
        kk = k.to(self.kernel_dtype)
        self.kk = kk.repeat_interleave(self.n_rep, dim=1) if self.n_rep > 1 else kk
        self.kv = value.to(self.kernel_dtype)                                      # [B, Hkv, T, dv]
        self.dtype = dtype
        self.scale = float(scale)
        self.allowed = mask                                                        # boolean or None
        self.lengths = lengths.to(q.device)
        # the kernels' own causal flag where the mask is causal with right padding (a padded query
        # then sees padded sources too: its weight in every statistic is 0 and no real query sees
        # it): no [B, 1, T, T] float mask, 4x the boolean one. A sliding window shorter than the
        # input (with right padding): the kernels run per band of ``window`` queries and the sources
        # they can see (:attr:`bands`), each with its own small float mask. Any other mask is handed
        # to the kernels whole as that float mask (ATen's fused kernels take no window or boolean
        # mask): quadratic in T, docs/benchmark-analyze.md "Long inputs".
        T = q.shape[2]
        no_window = window is None or window >= T
        causal = mask is None or (no_window and describes(mask, None, self.lengths))
        if no_window:                   # the same check as the winner's and PᵀF's: done once
            self.__dict__["_masks_described"] = causal
        self.bands: list[tuple[int, int, int]] | None = None
        if not causal and not no_window and self._masks_described:
            step = max(window, T // 256)
            self.bands = [(i0, min(T, i0 + step), max(0, i0 - window + 1)) for i0 in range(0, T, step)]
        self.mask = None if causal or self.bands else additive_mask(mask, self.kernel_dtype)
        self.route = "fused" if self.mask is None else WHOLE_MASK_ROUTE
        self.sinks = None if sinks is None else sinks.to(dtype)
        self.G, self.G_full = G.to(dtype), G_full.to(dtype)

    @cached_property
    def q(self) -> torch.Tensor:
        """Queries ``[B, H, T, dk]`` in the statistics' dtype."""
        return self.kq.to(self.dtype)

    @cached_property
    def k(self) -> torch.Tensor:
        """Keys per query head ``[B, H, T, dk]`` in the statistics' dtype."""
        return self.kk.to(self.dtype)

    @cached_property
    def value(self) -> torch.Tensor:
        """Values ``[B, Hkv, T, dv]`` in the statistics' dtype."""
        return self.kv.to(self.dtype)

    # ---- geometry -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, T, _ = self.kq.shape
        return B, H, T, T

    @cached_property
    def q_positions(self) -> torch.Tensor:
        return torch.arange(self.kq.shape[2], device=self.kq.device)

    @property
    def k_positions(self) -> torch.Tensor:
        return self.q_positions

    @cached_property
    def query_valid(self) -> torch.Tensor:
        """``[B, T]`` bool: the query is a real token (not right padding)."""
        return self.q_positions[None, :] < self.lengths[:, None]

    @cached_property
    def v(self) -> torch.Tensor:
        """Values per query head ``[B, H, T, dv]``."""
        return self.value.repeat_interleave(self.n_rep, dim=1) if self.n_rep > 1 else self.value

    @cached_property
    def value_norm(self) -> torch.Tensor:
        """``‖ṽ_j^h‖``: ``[B, H, T]``."""
        return metrics.projected_value_norm(self.v, self.G)

    @cached_property
    def raw_value_norm(self) -> torch.Tensor:
        """``‖v_j^h‖`` in head space: ``[B, H, T]``."""
        return self.v.norm(dim=-1)

    def visible_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``[B|1, 1, T]`` bool: whether query ``rows[i]`` sees source ``cols[i]``."""
        if self.allowed is None:
            return (cols <= rows)[None, None]
        T = rows.shape[0]
        idx = cols.view(1, 1, T, 1).expand(self.allowed.shape[0], 1, T, 1)
        return self.allowed.gather(-1, idx).squeeze(-1)

    # ---- the forward: head outputs, Σ_j a_ij k_j and lse ------------------------------------------
    @cached_property
    def _forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """``(u, Σ_j a_ij k_j, lse, saved)`` of the real tokens' softmax (without the learned sink),
        one fused call with ``[v | k]`` as values."""
        kv = self.kv.repeat_interleave(self.n_rep, dim=1) if self.n_rep > 1 else self.kv
        x = torch.cat([kv, self.kk], dim=-1)
        if self.bands is None:
            out, lse, saved = attend(self.kq, self.kk, x, self.scale, self.mask)
        else:                           # queries i0:i1 see sources k0:i1 only (a sliding window)
            parts = [attend(self.kq[:, :, i0:i1], self.kk[:, :, k0:i1], x[:, :, k0:i1], self.scale,
                            self._band_mask(i0, i1, k0)) for i0, i1, k0 in self.bands]
            out, lse = torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
            saved = [p[2] for p in parts]
        out, dv = out.to(self.dtype), kv.shape[-1]
        return out[..., :dv], out[..., dv:], lse, saved

    @cached_property
    def lse(self) -> torch.Tensor:
        """``lse_i`` of the whole row, the learned sink included: ``[B, H, T]``."""
        lse = self._forward[2].to(self.q.dtype)
        if self.sinks is None:
            return lse
        return torch.logaddexp(lse, self.sinks.view(1, -1, 1))

    @cached_property
    def gamma(self) -> torch.Tensor | None:
        """``γ_i = 1 − a_i∅`` (the real tokens' share of the row), None without learned sinks."""
        if self.sinks is None:
            return None
        return torch.exp(self._forward[2].to(self.q.dtype) - self.lse)

    @cached_property
    def learned_sink(self) -> torch.Tensor | None:
        """``a_i∅ = exp(s_∅ − lse_i)``: ``[B, H, T]``, None without learned sinks."""
        return None if self.sinks is None else torch.exp(self.sinks.view(1, -1, 1) - self.lse)

    def _rescaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.gamma is None else x * self.gamma.unsqueeze(-1)

    @cached_property
    def head_output(self) -> torch.Tensor:
        """``u_i^h = Σ_j a_ij v_j`` (head space): ``[B, H, T, dv]``."""
        return self._rescaled(self._forward[0])

    # ---- per query ---------------------------------------------------------------------------------
    def attention_column(self, col: int) -> torch.Tensor:
        """``a_ij`` for one source ``j = col`` and every query: ``[B, H, T]`` (0 where hidden)."""
        T = self.q.shape[2]
        s = (self.q @ self.k[:, :, col].unsqueeze(-1)).squeeze(-1) * self.scale          # [B, H, T]
        a = torch.exp(s - self.lse)
        return torch.where(self.visible_at(self.q_positions, torch.full((T,), col, device=s.device)), a, 0.0)

    @cached_property
    def self_attention(self) -> torch.Tensor:
        """``a_ii``: ``[B, H, T]``."""
        s = (self.q * self.k).sum(-1) * self.scale
        return torch.where(self.visible_at(self.q_positions, self.q_positions), torch.exp(s - self.lse), 0.0)

    @cached_property
    def entropy(self) -> torch.Tensor:
        """``H_i = lse_i − Σ_j a_ij s_ij`` (``− a_i∅ s_∅`` too with a learned sink), with
        ``Σ_j a_ij s_ij = scale·q_i·Σ_j a_ij k_j``: ``[B, H, T]``."""
        mean_score = self.scale * (self.q * self._rescaled(self._forward[1])).sum(-1)
        h = self.lse - mean_score
        if self.sinks is not None:
            h = h - self.learned_sink * self.sinks.view(1, -1, 1)
        return h.clamp_min(0.0)

    @cached_property
    def uG(self) -> torch.Tensor:
        return self.head_output @ self.G

    @cached_property
    def head_output_sq(self) -> torch.Tensor:
        return (self.uG * self.head_output).sum(-1).clamp_min(0.0)

    @cached_property
    def head_output_norm(self) -> torch.Tensor:
        return self.head_output_sq.sqrt()

    @cached_property
    def pulled_back(self) -> torch.Tensor:
        return metrics.pulled_back(self.head_output, self.G_full)

    @cached_property
    def head_dot_output(self) -> torch.Tensor:
        return (self.pulled_back * self.head_output).sum(-1)

    @cached_property
    def output_sq(self) -> torch.Tensor:
        return self.head_dot_output.sum(1).clamp_min(0.0)

    @property
    def output_norm(self) -> torch.Tensor:
        """``‖o_i‖``: ``[B, T]``."""
        return self.output_sq.sqrt()

    @cached_property
    def head_share(self) -> torch.Tensor:
        return metrics.safe_div(self.head_dot_output, self.output_sq.unsqueeze(1))

    def contribution_column(self, col: int) -> torch.Tensor:
        """``c_ij^h`` for source ``col``: ``[B, H, T]``."""
        return metrics.contribution_column(self.attention_column(col), self.uG, self.v[:, :, col],
                                           self.head_output_sq)

    def contribution_inter_column(self, col: int) -> torch.Tensor:
        """``C_ij^h`` for source ``col``: ``[B, H, T]``."""
        return metrics.contribution_inter_column(self.attention_column(col), self.pulled_back, self.v[:, :, col],
                                                 self.output_sq)

    def winner(self, norms: torch.Tensor) -> torch.Tensor:
        """The source winner ``argmax_j a_ij n_j`` of every query (SPEC §6): ``[B, H, T]`` long;
        ``norms [B, H, T]``. The fused kernel (:func:`attngeom.capture.fused_winner.source_winner`)
        when the mask is causal with the call's sliding window and right padding, else
        :func:`source_winner_masked`."""
        from attngeom.capture.fused_winner import source_winner

        norms = norms.to(self.q.dtype)
        if self.allowed is None:            # the call is causal (its window, if any, reaches every source)
            return source_winner(self.kq, self.kk, norms, scale=self.scale, causal=True)[0]
        if self._masks_described:
            return source_winner(self.kq, self.kk, norms, scale=self.scale, causal=True, window=self.window,
                                 lengths=self.lengths)[0]
        return source_winner_masked(self.q, self.k, norms, scale=self.scale, mask=self.allowed)

    # ---- per source ---------------------------------------------------------------------------------
    @cached_property
    def _masks_described(self) -> bool:
        """Whether the mask is causal with the call's window and right padding (or None)."""
        return self.allowed is None or describes(self.allowed, self.window, self.lengths)

    def transposed(self, F: torch.Tensor) -> torch.Tensor:
        """``PᵀF`` with the layer's attention ``P`` (learned sink included): ``[B, H, T, m]``. Where
        triton runs (:func:`attngeom.capture.fused_winner.uses_triton`) and the mask is causal with
        the call's window and padding, :func:`attngeom.capture.fused_winner.values_gradient` (``P``
        recomputed from ``lse``, no ``dQ``, ``dK``; in bf16/fp16 ``P`` is rounded to that dtype before
        its product, as the backward's is); else the attention's backward (:func:`transpose`)."""
        from attngeom.capture import fused_winner

        F = self._rescaled(F).to(self.kernel_dtype)
        if self._masks_described and fused_winner.uses_triton(self.kq.device, self.kq.dtype):
            masked = self.allowed is not None
            return fused_winner.values_gradient(
                self.kq, self.kk, self._forward[2], F, scale=self.scale, causal=True,
                window=self.window if masked else None, lengths=self.lengths if masked else None).to(self.dtype)
        if self.bands is None:
            return transpose(self.kq, self.kk, self._forward[3], F, self.scale, self.mask).to(self.dtype)
        out = torch.zeros(*F.shape, dtype=self.dtype, device=F.device)
        for (i0, i1, k0), saved in zip(self.bands, self._forward[3]):
            out[:, :, k0:i1] += transpose(self.kq[:, :, i0:i1], self.kk[:, :, k0:i1], saved, F[:, :, i0:i1],
                                          self.scale, self._band_mask(i0, i1, k0)).to(self.dtype)
        return out

    def _band_mask(self, i0: int, i1: int, k0: int) -> torch.Tensor:
        """The float mask of queries ``i0:i1`` over sources ``k0:i1`` (:attr:`bands`)."""
        return additive_mask(self.allowed[:, :, i0:i1, k0:i1], self.kernel_dtype)

    def seen_by(self, w: torch.Tensor) -> torch.Tensor:
        """``Σ_i w_i [query i sees source j]``: ``[B, T]``."""
        if self.allowed is None:
            return w.flip(-1).cumsum(-1).flip(-1)
        B, T = w.shape
        seen = self.allowed.expand(B, 1, T, T)[:, 0]
        out = w.new_zeros(B, T)
        step = max(1, (1 << 22) // max(1, B * T))
        for i0 in range(0, T, step):
            out += (w[:, None, i0:i0 + step] @ seen[:, i0:i0 + step].to(w.dtype)).squeeze(1)
        return out

    def received(self, weight: torch.Tensor, names: Iterable[str], value_norm: torch.Tensor | None = None,
                 ) -> dict[str, torch.Tensor]:
        """What each source receives, ``Σ_i w_i s_ij`` for the token-level scores of SPEC §2
        (``attention``, ``value_weighted``, ``output_normalized``, ``contribution``; as
        :func:`attngeom.metrics.formulas.received`): ``{name: [B, T]}`` from one ``PᵀF`` whose
        columns are ``w`` (attention, value-weighted), ``w/‖o_i^h‖`` (output-normalised) and
        ``w p_i^h/‖o_i‖²`` (contribution: ``Σ_i w_i C_ij^h = v_j^h·(Pᵀ X^h)_j``).
        ``value_norm [B, H, T]``: ``‖ṽ_j^h‖`` (the value-weighted and output-normalised ones)."""
        names = tuple(names)
        w = weight.to(self.q.dtype)
        B, H, T, _ = self.q.shape
        cols, at = [], {}
        if "attention" in names or "value_weighted" in names:
            at["plain"] = len(cols)
            cols.append(w[:, None, :, None].expand(B, H, T, 1))
        if "output_normalized" in names:
            at["normalized"] = len(cols)
            cols.append((w[:, None, :] * metrics.safe_div(torch.ones_like(self.head_output_norm),
                                                          self.head_output_norm)).unsqueeze(-1))
        if "contribution" in names:
            at["contribution"] = len(cols)
            cols.append(self.pulled_back * metrics.safe_div(w, self.output_sq)[:, None, :, None])
        out: dict[str, torch.Tensor] = {}
        if not cols:
            return out
        R = self.transposed(torch.cat(cols, dim=-1))                                  # [B, H, T, m]
        if "plain" in at:
            att = R[..., at["plain"]]
            if "attention" in names:
                out["attention"] = att.mean(1)
            if "value_weighted" in names:
                out["value_weighted"] = (att * value_norm).sum(1)
        if "normalized" in at:
            out["output_normalized"] = (R[..., at["normalized"]] * value_norm).sum(1)
        if "contribution" in at:
            c = at["contribution"]
            out["contribution"] = (R[..., c:c + self.v.shape[-1]] * self.v).sum((1, 3))
        return {n: out[n] for n in names}


# --------------------------------------------------------------------------------------------
# The capture's choice, per layer, and the layer on the fused route
# --------------------------------------------------------------------------------------------


def layer_route(session, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                softcap: float | None) -> str:
    """The route an observed attention call takes under ``session`` (its ``route``, observers,
    intervention and prepared maps): ``"fused"``, or ``"block"`` followed by why when the session
    asked for the fused one (``"block: soft-capping ..."``) -- what the run records per layer."""
    if session.route == "block" or (session.route == "auto" and not auto_fused(query.device)):
        return "block"
    if not session.observers:       # nothing to compute: the layer is the model's own (eager) attention
        return "block"
    if session.intervention is not None:
        return "block: an intervention edits the blocks"
    if session.prepared:
        return "block: measures prepared before the forward are read block by block"
    for obs in session.observers:
        if not getattr(obs, "fused", False):
            return f"block: {type(obs).__name__} reads blocks"
    reason = unsupported(query, key, mask, softcap)
    return "fused" if reason is None else f"block: {reason}"


def fused_attention(observers, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scaling: float, G: torch.Tensor, G_full: torch.Tensor,
                    lengths: torch.Tensor, sinks: torch.Tensor | None = None, window: int | None = None,
                    ) -> tuple[torch.Tensor, str]:
    """One attention call on the fused route: the layer's :class:`FusedLayer` handed to every
    observer's ``observe_layer``; returns the attention output ``[B, T, H, dv]`` in the call's dtype
    (the fused kernel's) and the route taken (``"fused"``, or :data:`WHOLE_MASK_ROUTE`)."""
    fused = FusedLayer(query.detach(), key.detach(), value.detach(), scaling, mask, G, G_full, lengths,
                       sinks=None if sinks is None else sinks.detach(), layer=layer, window=window)
    for obs in observers:
        obs.observe_layer(fused)
    return fused.head_output.transpose(1, 2).to(query.dtype).contiguous(), fused.route
