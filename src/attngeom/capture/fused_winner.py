"""The source winner of SPEC §6 (and the row's entropy) without a ``[Q, S]`` map: one fused pass over the keys.

For D1 (the route selection) -- the interface, identical for both implementations::

    source_winner(q, k, v_norm, *, scale, causal=True, window=None, softcap=None,
                  lengths=None, sinks=None, return_lse=False, return_entropy=False, block_elements=DEFAULT)
        -> (index LongTensor[B, H, Q], value Tensor[B, H, Q])
           (+ lse [B, H, Q] with return_lse, then + entropy [B, H, Q] with return_entropy)

``q [B, H, Q, d]``, ``k [B, Hkv, S, d]`` as the attention call receives them (``H`` a multiple of
``Hkv``: query head ``h`` reads key head ``h // (H / Hkv)``, ``repeat_kv``'s layout); ``v_norm
[B, Hn, S]`` the norms ``n_j`` the winner weighs by, per key/value head (``Hn = Hkv``: ``‖v_j‖``) or
per query head (``Hn = H``: ``‖ṽ_j^h‖``, ``winner_norm="projected"``). The queries are the last
``Q`` of the ``S`` sources (query row ``r`` is position ``S - Q + r``: the plug-in's ``q_start``).
Query ``i`` sees source ``j`` iff ``j <= i`` (``causal``), ``j > i - window`` (``window``:
transformers' ``sliding_window_overlay``) and ``j < lengths[b]`` (``lengths``: right padding). Logits
are ``scale · q_i·k_j``, soft-capped as ``softcap · tanh(x / softcap)``; ``sinks [H]`` are learned sink
logits (gpt-oss: SPEC §1), which change every ``a_ij`` but not which source wins.

``index[b, h, i] = j* = argmax_j a_ij n_j``, the first maximum (``argmax``'s tie rule, as
``attngeom.streaming.reducers._winner_is_self_or_sink``); ``0`` where every product is 0 (all
visible norms 0; or a padded query that sees no source), the first of the equal zeros over all ``j``.
``value = a_ij* n_j*`` (0 there). ``lse`` is the
row's log-sum-exp over the real sources (the learned sink left out). ``entropy`` is the row's
entropy in nats, ``H_i = lse_i − Σ_j a_ij s_ij`` (the learned sink one more outcome, SPEC §1; 0 for
a query that sees nothing), from a running sum of ``p·s`` in the same pass: no second pass and no
``k`` among the values of a forward.

For speed on CUDA pass ``q`` and ``k`` in the model's dtype (bf16 and fp16 multiply on the tensor
cores, float32 on the CUDA cores: 67 against 989 TFLOP/s on an H100, docs/benchmark-analyze.md) and
``k`` per key/value head (not repeated).

Why no ``[Q, S]`` map is needed: ``a_ij = exp(s_ij − lse_i)``, so ``argmax_j a_ij n_j = argmax_j
(s_ij + log n_j)`` (``exp`` is increasing and ``lse_i`` is the same for the whole row). A running
maximum of ``s_ij + log n_j`` with its first index, and the running ``(max, sum of exp)`` of the
logits (online softmax), go over the keys block by block; then ``value = exp(best − lse)``.

Two implementations of that one pass:

- :func:`source_winner_triton`: a Triton kernel (one program per block of queries and head, the
  keys in blocks, flash-attention style). Used for CUDA tensors when triton is installed, and for
  CPU tensors when ``TRITON_INTERPRET=1`` is set (triton's interpreter runs it with numpy: how it is
  tested on machines without a GPU, tests/unit/test_fused_winner.py).
- :func:`source_winner_torch`: the same pass in torch, over blocks of queries with at most
  ``block_elements`` elements of ``B·H·Q·S`` each (one logit block, never the ``[Q, S]`` map of a
  whole layer at once). Used everywhere else.

:func:`source_winner` picks between them (:func:`uses_triton`).

The module's second pass, :func:`values_gradient` (same arguments, with ``lse [B, H, Q]`` and
``F [B, H, Q, m]`` instead of ``v_norm``; the same two implementations), gives ``PᵀF``: what the
attention's backward gives as the values' gradient, without its ``dQ`` and ``dK``. With it and the
entropy above, the fused route needs the forward with ``v`` only, this pass and the winner's: about
2× the layer's attention on a GPU instead of 5× (docs/benchmark-analyze.md, "Routes", an estimate).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

triton = tl = None     # imported on first use (:func:`_triton`): optional, and slow to import


def _triton():
    """triton, imported once (the kernel reads ``tl`` from this module's globals)."""
    global triton, tl
    if triton is None:
        import triton as _t
        import triton.language as _tl
        triton, tl = _t, _tl
    return triton


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported here (without importing it)."""
    return importlib.util.find_spec("triton") is not None

BLOCK_ELEMENTS = 1 << 21
"""Default bound on ``B·H·Q·S`` of one logit block of :func:`source_winner_torch` (the capture's
default block budget on the CPU; the route passes its session's budget)."""


def _check(q: torch.Tensor, k: torch.Tensor, v_norm: torch.Tensor, window, softcap, lengths, sinks) -> None:
    B, H, Q, d = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != d or H % k.shape[1]:
        raise ValueError(f"k must be [B, Hkv, S, d] with H a multiple of Hkv; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    S, Hkv = k.shape[2], k.shape[1]
    if v_norm.dim() != 3 or v_norm.shape[0] != B or v_norm.shape[2] != S or v_norm.shape[1] not in (H, Hkv):
        raise ValueError(f"v_norm must be [B, H or Hkv, S]; got {tuple(v_norm.shape)} for H={H}, Hkv={Hkv}, S={S}")
    if Q > S:
        raise ValueError(f"more queries ({Q}) than sources ({S}): the queries are the last Q sources")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if lengths is not None and tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B]; got {tuple(lengths.shape)}")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must be [H]; got {tuple(sinks.shape)}")


def _finish(index, best, lse, mean_s, sinks, return_lse, return_entropy):
    """``value = exp(best − lse)`` (with learned sinks, ``lse`` over the sources and the sink) and
    the entropy ``lse − Σ_j a_ij s_ij`` from ``mean_s``, the real sources' mean logit."""
    lse_all = lse if sinks is None else torch.logaddexp(lse, sinks.to(lse).view(1, -1, 1))
    value = torch.where(best == float("-inf"), 0.0, torch.exp(best - lse_all))   # no source seen, or all n_j = 0
    out = (index, value, lse) if return_lse else (index, value)
    if return_entropy:
        if sinks is None:
            entropy = lse - mean_s
        else:                           # a_ij over every outcome: the real ones' share exp(lse − lse_all)
            sink = sinks.to(lse).view(1, -1, 1)
            entropy = lse_all - torch.exp(lse - lse_all) * mean_s - torch.exp(sink - lse_all) * sink
        out = (*out, torch.where(lse == float("-inf"), 0.0, entropy))
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logit_blocks(q, k, *, scale, causal, window, softcap, lengths, block_elements):
    """The torch passes' blocks of queries: ``(i0, i1, k0, k1, s, hidden)`` for queries ``i0:i1``
    with the sources ``k0:k1`` they can see, ``s`` their scaled (soft-capped) logits ``[B, H, i1-i0,
    k1-k0]`` in the accumulation dtype, not yet masked, and ``hidden`` the sources each query may
    not see (causal, window, padding), broadcastable to ``s``."""
    B, H, Q, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n_rep = H // Hkv
    acc = _acc_dtype(q.dtype)
    offset = S - Q
    step = max(1, min(Q, block_elements // max(1, B * H * S)))
    for i0 in range(0, Q, step):
        i1 = min(Q, i0 + step)
        p0, p1 = offset + i0, offset + i1                       # positions of the block's queries
        k0 = 0 if window is None else max(0, p0 - window + 1)
        k1 = min(S, p1) if causal else S
        qb = q[:, :, i0:i1].to(acc).reshape(B * Hkv, n_rep * (i1 - i0), d)
        kt = k[:, :, k0:k1].to(acc).reshape(B * Hkv, k1 - k0, d).transpose(1, 2)
        s = torch.baddbmm(qb.new_empty(()), qb, kt, beta=0, alpha=scale).view(B, H, i1 - i0, k1 - k0)
        if softcap is not None:
            s = s.div_(softcap).tanh_().mul_(softcap)
        qpos = torch.arange(p0, p1, device=q.device)[:, None]
        kpos = torch.arange(k0, k1, device=q.device)[None, :]
        hidden = torch.zeros(i1 - i0, k1 - k0, dtype=torch.bool, device=q.device)
        if causal:
            hidden |= kpos > qpos
        if window is not None:
            hidden |= kpos <= qpos - window
        hidden = hidden[None, None]
        if lengths is not None:
            hidden = hidden | (kpos >= lengths.to(q.device).view(B, 1, 1, 1))
        yield i0, i1, k0, k1, s, hidden


# --------------------------------------------------------------------------------------------
# The torch pass
# --------------------------------------------------------------------------------------------


def source_winner_torch(q, k, v_norm, *, scale, causal=True, window=None, softcap=None, lengths=None, sinks=None,
                        return_lse=False, return_entropy=False, block_elements=BLOCK_ELEMENTS):
    """:func:`source_winner` in torch: blocks of queries, each with the sources it can see."""
    _check(q, k, v_norm, window, softcap, lengths, sinks)
    B, H, Q, _ = q.shape
    acc = _acc_dtype(q.dtype)
    log_n = v_norm.to(acc).log()
    if v_norm.shape[1] != H:                                   # one norm per key head: its group's
        log_n = log_n.repeat_interleave(H // k.shape[1], dim=1)
    index = torch.zeros(B, H, Q, dtype=torch.long, device=q.device)
    best = torch.empty(B, H, Q, dtype=acc, device=q.device)
    lse = torch.empty(B, H, Q, dtype=acc, device=q.device)
    mean_s = torch.empty(B, H, Q, dtype=acc, device=q.device) if return_entropy else None
    for i0, i1, k0, k1, s, hidden in _logit_blocks(q, k, scale=scale, causal=causal, window=window, softcap=softcap,
                                                   lengths=lengths, block_elements=block_elements):
        s.masked_fill_(hidden, float("-inf"))
        lse[:, :, i0:i1] = torch.logsumexp(s, dim=-1)
        if return_entropy:              # Σ_j a_ij s_ij over the real sources (a hidden source adds 0)
            p = torch.exp(s - lse[:, :, i0:i1, None])
            mean_s[:, :, i0:i1] = (p * s.masked_fill(hidden, 0.0)).sum(-1)
        b, j = s.add_(log_n[:, :, None, k0:k1]).max(dim=-1)     # the first maximum
        best[:, :, i0:i1] = b
        index[:, :, i0:i1] = torch.where(b == float("-inf"), 0, j + k0)
    return _finish(index, best, lse, mean_s, sinks, return_lse, return_entropy)


# --------------------------------------------------------------------------------------------
# The Triton kernel
# --------------------------------------------------------------------------------------------


def _winner_kernel(Q_ptr, K_ptr, LN_ptr, LEN_ptr, IDX_ptr, BEST_ptr, LSE_ptr, MEAN_ptr,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, slb, slh, sln,
                   H, N_REP, LN_DIV, Q_LEN, S_LEN, OFFSET, D, WINDOW, scale, softcap,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                   HAS_LENGTHS: tl.constexpr, IEEE: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: ``BLOCK_M`` queries of one (text, head); the keys in blocks of ``BLOCK_N``.

    Builtins only, and ``tl.reduce`` with triton's own combine functions (what ``tl.max``/``tl.sum``
    call): ``tl.max`` and ``tl.zeros`` are themselves jit functions, compiled for the device or for
    the interpreter when triton is *imported* (``TRITON_INTERPRET`` then), and torch imports triton
    early (``torch._dynamo``); the interpreter recognises these combine functions either way.

    ``DOT_F32`` (set under the interpreter for bf16 only; see :data:`INTERPRETER_BF16_DOT`) multiplies
    bf16 tiles as float32: the same products, since a product of two bf16 values is exact in float32."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)           # 64-bit offsets: a long input's q and k pass 2^31 elements
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = OFFSET + offs_m                                                   # query positions
    q = tl.load(Q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < Q_LEN) & (offs_d[None, :] < D), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K_ptr + b * skb + (h // N_REP) * skh
    ln_base = LN_ptr + b * slb + (h // LN_DIV) * slh

    acc_ty = tl.float64 if Q_ptr.dtype.element_ty == tl.float64 else tl.float32
    m_i = tl.full([BLOCK_M], float("-inf"), acc_ty)                        # running max of the logits
    l_i = tl.full([BLOCK_M], 0.0, acc_ty)                                   # running sum of exp(s - m_i)
    u_i = tl.full([BLOCK_M], 0.0, acc_ty)                                   # running sum of exp(s - m_i) * s
    best = tl.full([BLOCK_M], float("-inf"), acc_ty)                       # running max of s + log n
    idx = tl.full([BLOCK_M], 0, tl.int64)
    cols = tl.broadcast_to(tl.arange(0, BLOCK_N)[None, :], (BLOCK_M, BLOCK_N))

    hi = S_LEN
    if CAUSAL:
        hi = tl.minimum(hi, OFFSET + (start_m + 1) * BLOCK_M)
    if HAS_LENGTHS:
        length = tl.load(LEN_ptr + b)
        hi = tl.minimum(hi, length)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, OFFSET + start_m * BLOCK_M - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=(offs_n[:, None] < S_LEN) & (offs_d[None, :] < D), other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_ty)
        else:
            s = tl.dot(q, tl.trans(k), out_dtype=acc_ty)
        s = s * scale
        if SOFTCAP:                     # softcap * tanh(s / softcap), tanh from exp (no libdevice in the interpreter)
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t)
        visible = (offs_n[None, :] < S_LEN) & (offs_m[:, None] < Q_LEN)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - WINDOW)
        if HAS_LENGTHS:
            visible = visible & (offs_n[None, :] < length)
        s = tl.where(visible, s, float("-inf"))
        # online log-sum-exp
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if ENTROPY:
            u_i = u_i * alpha + tl.reduce(p * tl.where(visible, s, 0.0), 1, tl.standard._sum_combine)
        m_i = m_new
        # running first maximum of s + log n: a later block wins only when strictly above
        ln = tl.load(ln_base + offs_n * sln, mask=offs_n < S_LEN, other=float("-inf"))
        key = s + ln[None, :]
        blk_best, blk_idx = tl.reduce((key, cols), 1, tl.standard._argmax_combine_tie_break_left)
        better = blk_best > best
        best = tl.where(better, blk_best, best)
        idx = tl.where(better, start_n + blk_idx.to(tl.int64), idx)

    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))   # -inf: no source seen
    out = (b * H + h) * Q_LEN + offs_m
    keep = offs_m < Q_LEN
    tl.store(IDX_ptr + out, idx, mask=keep)
    tl.store(BEST_ptr + out, best, mask=keep)
    tl.store(LSE_ptr + out, lse, mask=keep)
    if ENTROPY:
        tl.store(MEAN_ptr + out, u_i / tl.where(l_i > 0, l_i, 1.0), mask=keep)


INTERPRETER_BF16_DOT = "multiplied as float32"
"""How the kernels multiply bf16 tiles under triton's interpreter. Its ``tl.dot`` (triton 3.9,
``triton/runtime/interpreter.py``, ``create_dot``) is ``np.matmul`` of the operands' storage, and the
interpreter stores bf16 as ``uint16`` (numpy has no bf16): it multiplies the *bit patterns* as
integers (only 8-bit floats are converted first; 1.0 is 16256 there), so a bf16 ``q·k`` came out
orders of magnitude too large and ``exp`` of it overflowed (``PᵀF`` off by ~1e10; float32, float16
and float64 are stored as themselves and are right). That is the interpreter's alone: on a GPU ``tl.dot`` of bf16 tiles is
the tensor cores' MMA (``test_kernel_compiles_for_an_h100`` finds ``mma`` in the PTX). So under
the interpreter (``DOT_F32``) the bf16 tiles are cast to float32 before ``tl.dot``: every product
of two bf16 values is exact in float32 and both accumulate in float32, so this is the tensor cores'
arithmetic up to the order of the sums. ``P`` is rounded to bf16 before ``PᵀF`` on both; the
interpreter truncates it (``_convert_float`` without a rounding mode) where the GPU rounds to
nearest: at most one bf16 ulp (2⁻⁷ relative) instead of half (tests/unit/test_fused_winner.py::
test_bf16_kernels_under_the_interpreter_are_within_bf16_rounding)."""


@functools.cache
def _compiled(kernel, interpret: bool):
    """``kernel`` for the device (``triton.jit``'s ``JITFunction``) or for triton's interpreter.
    Chosen per call rather than when this module is imported (``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates), so the variable may be set or unset at any time."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(kernel)
    from triton.runtime.jit import JITFunction
    return JITFunction(kernel)


def uses_triton(device: torch.device | str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`source_winner` runs the Triton kernel for tensors on ``device``: on CUDA (not
    float64, which tensor cores do not multiply) when triton is installed and torch sees a CUDA
    device (tensors of a fake CUDA device, as in tests/device, take the torch pass); on the CPU only
    under ``TRITON_INTERPRET=1``."""
    if not triton_installed():
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return device.type == "cuda" and dtype != torch.float64 and torch.cuda.is_available()   # not fake devices


def source_winner_triton(q, k, v_norm, *, scale, causal=True, window=None, softcap=None, lengths=None, sinks=None,
                         return_lse=False, return_entropy=False, block_m=None, block_n=None):
    """:func:`source_winner` by the Triton kernel (``block_m``/``block_n``: the tile, powers of two of
    at least 16; default 64, and 16 under the interpreter)."""
    if not triton_installed():
        raise RuntimeError("triton is not installed: use source_winner_torch (or source_winner, which picks)")
    _check(q, k, v_norm, window, softcap, lengths, sinks)
    B, H, Q, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    interpret = q.device.type == "cpu"
    triton = _triton()
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"q must be a floating tensor, got {q.dtype}")
    k = k.to(q.dtype)
    acc = _acc_dtype(q.dtype)
    log_n = v_norm.to(acc).log().contiguous()
    block_m = block_m or (16 if interpret else 64)
    block_n = block_n or (16 if interpret else 64)
    index = torch.empty(B, H, Q, dtype=torch.long, device=q.device)
    best = torch.empty(B, H, Q, dtype=acc, device=q.device)
    lse = torch.empty(B, H, Q, dtype=acc, device=q.device)
    mean_s = torch.empty(B, H, Q, dtype=acc, device=q.device) if return_entropy else lse    # not written without
    lens = (lengths.to(device=q.device, dtype=torch.int64).contiguous() if lengths is not None
            else torch.zeros(1, dtype=torch.int64, device=q.device))
    grid = (triton.cdiv(Q, block_m), B * H)
    _compiled(_winner_kernel, interpret)[grid](
        q, k, log_n, lens, index, best, lse, mean_s,
        *q.stride(), *k.stride(), *log_n.stride(),
        H, H // Hkv, H // log_n.shape[1], Q, S, S - Q, d, window or 0, float(scale), float(softcap or 1.0),
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, SOFTCAP=softcap is not None,
        HAS_LENGTHS=lengths is not None, IEEE=q.dtype in (torch.float32, torch.float64), ENTROPY=bool(return_entropy),
        DOT_F32=interpret and q.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)))
    return _finish(index, best, lse, mean_s, sinks, return_lse, return_entropy)


def source_winner(q, k, v_norm, *, scale, causal=True, window=None, softcap=None, lengths=None, sinks=None,
                  return_lse=False, return_entropy=False, block_elements=BLOCK_ELEMENTS):
    """The source winner ``argmax_j a_ij n_j`` of every query and head, and ``a_ij* n_j*`` (see the
    module's docstring for the arguments): the Triton kernel where :func:`uses_triton`, else the torch
    pass; both equal ``argmax`` over the exact attention map up to rounding of near ties."""
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, lengths=lengths, sinks=sinks,
              return_lse=return_lse, return_entropy=return_entropy)
    if uses_triton(q.device, q.dtype):
        return source_winner_triton(q, k, v_norm, **kw)
    return source_winner_torch(q, k, v_norm, **kw, block_elements=block_elements)


# --------------------------------------------------------------------------------------------
# PᵀF: what every source receives, without the attention's full backward
# --------------------------------------------------------------------------------------------


def _check_f(q, k, lse, F, window, softcap, lengths) -> None:
    B, H, Q, _ = q.shape
    _check(q, k, torch.empty(B, k.shape[1], k.shape[2], device="meta"), window, softcap, lengths, None)
    if tuple(lse.shape) != (B, H, Q) or F.dim() != 4 or tuple(F.shape[:3]) != (B, H, Q):
        raise ValueError(f"lse must be [B, H, Q] and F [B, H, Q, m]; got {tuple(lse.shape)} and {tuple(F.shape)} "
                         f"for q {tuple(q.shape)}")


def values_gradient_torch(q, k, lse, F, *, scale, causal=True, window=None, softcap=None, lengths=None,
                          block_elements=BLOCK_ELEMENTS):
    """:func:`values_gradient` in torch: blocks of queries, ``Pᵀ F`` of each added to its sources."""
    _check_f(q, k, lse, F, window, softcap, lengths)
    B, H, S = q.shape[0], q.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(B, H, S, F.shape[-1], dtype=acc, device=q.device)
    for i0, i1, k0, k1, s, hidden in _logit_blocks(q, k, scale=scale, causal=causal, window=window, softcap=softcap,
                                                   lengths=lengths, block_elements=block_elements):
        rows = lse[:, :, i0:i1, None].to(acc)
        p = s.sub_(torch.where(rows == float("-inf"), 0.0, rows)).exp_().masked_fill_(hidden, 0.0)
        out[:, :, k0:k1] += p.transpose(-1, -2) @ F[:, :, i0:i1].to(acc)
    return out


def _values_grad_kernel(Q_ptr, K_ptr, LSE_ptr, F_ptr, LEN_ptr, OUT_ptr,
                        sqb, sqh, sqm, sqd, skb, skh, skn, skd, slb, slh, slm, sfb, sfh, sfm, sfc,
                        H, N_REP, Q_LEN, S_LEN, OFFSET, D, M, WINDOW, scale, softcap,
                        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                        HAS_LENGTHS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: ``BLOCK_N`` sources of one (text, head); the queries that can see them in
    blocks of ``BLOCK_M``: ``P`` recomputed from ``q``, ``k`` and ``lse``, times ``F``'s rows.
    ``P`` is rounded to ``F``'s dtype before its product (bf16/fp16: the tensor cores' inputs);
    ``DOT_F32`` as in :func:`_winner_kernel` (the rounded ``P`` and ``F`` then multiplied as float32)."""
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    k = tl.load(K_ptr + b * skb + (h // N_REP) * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=(offs_n[:, None] < S_LEN) & (offs_d[None, :] < D), other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    acc_ty = tl.float64 if Q_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.full([BLOCK_N, BLOCK_C], 0.0, acc_ty)
    if HAS_LENGTHS:
        length = tl.load(LEN_ptr + b)
    lo = 0
    if CAUSAL:                                   # rows whose position reaches the block's first source
        lo = tl.maximum(0, start_n * BLOCK_N - OFFSET)
        lo = (lo // BLOCK_M) * BLOCK_M
    hi = Q_LEN
    if HAS_WINDOW:                               # rows within the window of the block's last source
        hi = tl.minimum(hi, (start_n + 1) * BLOCK_N + WINDOW - 1 - OFFSET)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        pos = OFFSET + offs_m
        q = tl.load(Q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Q_LEN) & (offs_d[None, :] < D), other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_ty)
        else:
            s = tl.dot(q, tl.trans(k), out_dtype=acc_ty)
        s = s * scale
        if SOFTCAP:
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t)
        visible = (offs_m[:, None] < Q_LEN) & (offs_n[None, :] < S_LEN)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - WINDOW)
        if HAS_LENGTHS:
            visible = visible & (offs_n[None, :] < length)
        lse = tl.load(LSE_ptr + b * slb + h * slh + offs_m * slm, mask=offs_m < Q_LEN, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        p = tl.where(visible, tl.exp(tl.where(visible, s, 0.0) - lse[:, None]), 0.0)
        f = tl.load(F_ptr + b * sfb + h * sfh + offs_m[:, None] * sfm + offs_c[None, :] * sfc,
                    mask=(offs_m[:, None] < Q_LEN) & (offs_c[None, :] < M), other=0.0)
        pt = tl.trans(p.to(F_ptr.dtype.element_ty))
        if DOT_F32:
            pt = pt.to(tl.float32)
            f = f.to(tl.float32)
        if IEEE:
            acc += tl.dot(pt, f, input_precision="ieee", out_dtype=acc_ty)
        else:
            acc += tl.dot(pt, f, out_dtype=acc_ty)
    out = OUT_ptr + ((b * H + h) * S_LEN + offs_n[:, None]) * M + offs_c[None, :]
    tl.store(out, acc, mask=(offs_n[:, None] < S_LEN) & (offs_c[None, :] < M))


def values_gradient_triton(q, k, lse, F, *, scale, causal=True, window=None, softcap=None, lengths=None,
                           block_m=None, block_n=None):
    """:func:`values_gradient` by the Triton kernel (tiles as :func:`source_winner_triton`'s)."""
    if not triton_installed():
        raise RuntimeError("triton is not installed: use values_gradient_torch (or values_gradient, which picks)")
    _check_f(q, k, lse, F, window, softcap, lengths)
    B, H, Q, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    interpret = q.device.type == "cpu"
    triton = _triton()
    k = k.to(q.dtype)
    acc = _acc_dtype(q.dtype)
    lse = lse.to(acc)
    F = F.to(q.dtype if q.dtype in (torch.float16, torch.bfloat16) else acc)
    block_m = block_m or (16 if interpret else 64)
    block_n = block_n or (16 if interpret else 64)
    out = torch.empty(B, H, S, F.shape[-1], dtype=acc, device=q.device)
    lens = (lengths.to(device=q.device, dtype=torch.int64).contiguous() if lengths is not None
            else torch.zeros(1, dtype=torch.int64, device=q.device))
    grid = (triton.cdiv(S, block_n), B * H)
    _compiled(_values_grad_kernel, interpret)[grid](
        q, k, lse, F, lens, out,
        *q.stride(), *k.stride(), *lse.stride(), *F.stride(),
        H, H // Hkv, Q, S, S - Q, d, F.shape[-1], window or 0, float(scale), float(softcap or 1.0),
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, SOFTCAP=softcap is not None,
        HAS_LENGTHS=lengths is not None, IEEE=q.dtype in (torch.float32, torch.float64),
        DOT_F32=interpret and q.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_C=max(16, triton.next_power_of_2(F.shape[-1])))
    return out


def values_gradient(q, k, lse, F, *, scale, causal=True, window=None, softcap=None, lengths=None,
                    block_elements=BLOCK_ELEMENTS):
    """``(PᵀF)_j = Σ_i P_ij F_i`` per head, ``[B, H, S, m]`` (float32, float64 for float64 inputs):
    what the attention's backward gives as the values' gradient for the output gradient ``F``,
    without its ``dQ`` and ``dK`` (two products per visible pair instead of five; ``m`` columns, e.g.
    the few signals of the per-source totals of SPEC §10, instead of the head size).

    ``P_ij = exp(s_ij − lse_i)`` on the pairs query ``i`` sees (masks, soft-capping and the query
    positions as in :func:`source_winner`; ``lengths`` hides sources only), ``lse [B, H, Q]`` as the
    caller gives it (:func:`source_winner`'s ``return_lse``, or a forward's; a learned sink is in it
    or not as the caller wants), ``F [B, H, Q, m]``. The Triton kernel where :func:`uses_triton`
    (``F`` in bf16/fp16 with bf16/fp16 ``q``: the tensor cores), else the torch pass."""
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, lengths=lengths)
    if uses_triton(q.device, q.dtype):
        return values_gradient_triton(q, k, lse, F, **kw)
    return values_gradient_torch(q, k, lse, F, **kw, block_elements=block_elements)
