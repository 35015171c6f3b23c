"""The fused source winner (attngeom.capture.fused_winner) against a float64 slow computation.

The slow reference forms the whole ``[Q, S]`` attention map in float64 (softmax of the masked,
soft-capped logits, a learned sink as one more logit), multiplies by the norms and takes
``argmax`` (its first maximum): the definition of SPEC §6, not the kernel's ``s + log n``. The
Triton kernel runs under triton's interpreter (``TRITON_INTERPRET=1``, set per test: the module
reads it at each call, so nothing depends on import order) on CPU tensors; the torch pass runs as it
does on a CPU. Indices must be equal, values equal to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch

from attngeom.capture import fused_winner as fw

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it on Linux)")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def slow_logits(q, k, *, scale, causal, window, softcap, lengths):
    """The float64 logits ``s_ij`` (soft-capped, ``repeat_kv`` for GQA) of every query against every
    source, and which pairs are visible: the queries are the last ``Q`` of the ``S`` sources."""
    B, H, Q, _ = q.shape
    S = k.shape[2]
    k = k.double().repeat_interleave(H // k.shape[1], dim=1)
    s = torch.einsum("bhqd,bhsd->bhqs", q.double(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    i, j = torch.arange(S - Q, S)[:, None], torch.arange(S)[None, :]
    visible = torch.ones(B, 1, Q, S, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= j > i - window
    if lengths is not None:
        visible &= j < lengths.view(B, 1, 1, 1)
    return s, visible


def slow_winner(q, k, n, *, scale, causal=True, window=None, softcap=None, lengths=None, sinks=None,
                entropy=False):
    """``argmax_j a_ij n_j`` and its value from the full float64 map (``repeat_kv`` for GQA); with
    ``entropy``, also ``−Σ a log a`` over every outcome (the learned sink one of them)."""
    B, H, Q, _ = q.shape
    S = k.shape[2]
    n = n.double().repeat_interleave(H // n.shape[1], dim=1)
    s, visible = slow_logits(q, k, scale=scale, causal=causal, window=window, softcap=softcap, lengths=lengths)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Q, 1)], dim=-1)
    full = torch.softmax(s, dim=-1).nan_to_num(0.0)                # a row that sees nothing: all 0
    a = full[..., :S]
    x = a * n[:, :, None, :]
    if entropy:
        return x.argmax(-1), x.amax(-1), -(full * full.clamp_min(1e-300).log()).sum(-1)
    return x.argmax(-1), x.amax(-1)


def both(q, k, n, **kw):
    """The kernel (small tiles: several key blocks even at short lengths) and the torch pass (small
    query blocks), each with its result."""
    return {"triton": fw.source_winner_triton(q, k, n, block_m=16, block_n=16, **kw),
            "torch": fw.source_winner_torch(q, k, n, block_elements=4 * 16 * k.shape[2], **kw)}


def inputs(B, H, Hkv, S, d, Q=None, seed=0, norms_per="kv", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    Q = S if Q is None else Q
    q = torch.randn(B, H, Q, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, d, generator=g, dtype=dtype)
    n = torch.rand(B, H if norms_per == "query" else Hkv, S, generator=g, dtype=dtype) * 2 + 0.05
    return q, k, n


CASES = {
    "causal": dict(),
    "gqa-per-query-norms": dict(norms_per="query"),
    "window": dict(window=7),
    "window-1": dict(window=1),
    "softcap": dict(softcap=1.5),
    "window-softcap": dict(window=20, softcap=3.0),
    "padded": dict(lengths=(53, 29)),
    "learned-sinks": dict(sinks=True),
    "not-causal-padded": dict(causal=False, lengths=(40, 53)),
    "decode-last-queries": dict(Q=5),
    "one-query": dict(Q=1, window=9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_winner_equals_the_float64_map(case, interpret):
    """Odd lengths (53: not a multiple of the 16-wide tiles), GQA (6 query heads on 2 key heads),
    every mask option; head size 24 (the tile pads it to 32)."""
    opt = dict(CASES[case])
    B, H, Hkv, S, d = 2, 6, 2, 53, 24
    q, k, n = inputs(B, H, Hkv, S, d, Q=opt.pop("Q", None), norms_per=opt.pop("norms_per", "kv"),
                     seed=len(case))
    if "lengths" in opt:
        opt["lengths"] = torch.tensor(opt["lengths"])
    if opt.pop("sinks", False):
        opt["sinks"] = torch.linspace(-1.0, 2.0, H, dtype=torch.float64)
    want_i, want_v, want_h = slow_winner(q, k, n, scale=0.4, entropy=True, **opt)
    for name, (idx, val) in both(q, k, n, scale=0.4, **opt).items():
        assert idx.dtype == torch.long and idx.shape == (B, H, q.shape[2]), name
        assert torch.equal(idx, want_i), (name, (idx != want_i).sum())
        torch.testing.assert_close(val, want_v, rtol=1e-12, atol=1e-15, msg=name)
    for name, (idx, val, ent) in both(q, k, n, scale=0.4, return_entropy=True, **opt).items():
        assert torch.equal(idx, want_i), name                       # the entropy changes nothing else
        torch.testing.assert_close(ent, want_h, rtol=1e-11, atol=1e-12, msg=name)
    if "lengths" in opt and opt.get("causal", True) and "window" not in opt:
        assert bool((want_v[1, :, 29:] > 0).all())     # a padded query still sees its real sources


def test_ties_go_to_the_first_source_also_across_key_blocks(interpret):
    """Integer q and k (exact logits): source 3 repeated at 5 (same key block) and at 20 and 37 (later
    blocks), with the same norm; and the query that sees all its sources with norm 0 in the second
    text (every product 0: index 0, value 0). ``argmax``'s rule: the first maximum."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, S, d = 2, 4, 2, 45, 16
    q = torch.randint(-2, 3, (B, H, S, d), generator=g).double()
    k = torch.randint(-2, 3, (B, Hkv, S, d), generator=g).double()
    n = torch.randint(1, 4, (B, Hkv, S), generator=g).double()
    for j in (5, 20, 37):
        k[:, :, j] = k[:, :, 3]
        n[:, :, j] = n[:, :, 3]
    q[:, :, 40:] = 3 * k[:, :, 3:4].repeat_interleave(2, dim=1)    # queries 40.. prefer source 3 strongly
    n[1] = 0.0
    want_i, want_v = slow_winner(q, k, n, scale=0.25)
    assert bool((want_i[0, :, 40:] == 3).all())                       # the tie exists and the first copy wins
    assert bool((want_i[1] == 0).all()) and bool((want_v[1] == 0).all())
    for name, (idx, val) in both(q, k, n, scale=0.25).items():
        assert torch.equal(idx, want_i), name
        torch.testing.assert_close(val, want_v, rtol=1e-12, atol=1e-15, msg=name)


def test_float32_agrees_except_within_rounding_of_a_tie(interpret):
    """In float32 every row whose top two products differ by more than 1e-4 (relative) picks the
    float64 winner, and values agree to float32 rounding."""
    B, H, Hkv, S, d = 1, 4, 4, 70, 32
    q, k, n = inputs(B, H, Hkv, S, d, seed=7, dtype=torch.float32)
    want_i, want_v = slow_winner(q, k, n, scale=d ** -0.5, softcap=5.0)
    top2 = torch.sort(_products(q, k, n, d ** -0.5, 5.0), dim=-1, descending=True).values[..., :2]
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4 * top2[..., 0]
    assert clear.float().mean() > 0.9
    for name, (idx, val) in both(q, k, n, scale=d ** -0.5, softcap=5.0).items():
        assert val.dtype == torch.float32
        assert torch.equal(idx[clear], want_i[clear]), name
        torch.testing.assert_close(val.double(), want_v, rtol=1e-5, atol=1e-7, msg=name)


def _products(q, k, n, scale, softcap):
    s = torch.tanh(torch.einsum("bhqd,bhsd->bhqs", q.double(), k.double()) * scale / softcap) * softcap
    S = k.shape[2]
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) * n.double()[:, :, None, :]


def test_entropy_with_lse_and_of_a_query_that_sees_nothing(interpret):
    """``return_lse`` and ``return_entropy`` together: ``(index, value, lse, entropy)``; a padded
    query whose window holds no real source has entropy 0 and value 0 (index 0)."""
    q, k, n = inputs(2, 4, 2, 40, 16, seed=5)
    lengths = torch.tensor([40, 12])
    _, _, want_h = slow_winner(q, k, n, scale=0.3, window=4, lengths=lengths, entropy=True)
    for name, out in both(q, k, n, scale=0.3, window=4, lengths=lengths, return_lse=True, return_entropy=True).items():
        idx, val, lse, ent = out
        torch.testing.assert_close(ent, want_h, rtol=1e-11, atol=1e-12, msg=name)
        assert bool((lse[1, :, 15:] == float("-inf")).all()) and bool((ent[1, :, 15:] == 0).all())
        assert bool((val[1, :, 15:] == 0).all()) and bool((idx[1, :, 15:] == 0).all())


def test_strided_inputs_and_lse(interpret):
    """q and k as transformers hands them (``[B, T, H, d]`` transposed: not contiguous); ``lse`` is
    the row's log-sum-exp."""
    g = torch.Generator().manual_seed(3)
    B, H, S, d = 1, 3, 33, 16
    q = torch.randn(B, S, H, d, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, S, H, d, generator=g, dtype=torch.float64).transpose(1, 2)
    n = torch.rand(B, H, S, generator=g, dtype=torch.float64) + 0.1
    s = (q @ k.transpose(-1, -2)) * 0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    want_i, _ = slow_winner(q, k, n, scale=0.5)
    for name, (idx, _, lse) in {"triton": fw.source_winner_triton(q, k, n, scale=0.5, return_lse=True),
                                "torch": fw.source_winner_torch(q, k, n, scale=0.5, return_lse=True)}.items():
        assert torch.equal(idx, want_i), name
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-13, atol=1e-13, msg=name)


def test_source_winner_runs_the_kernel_only_where_it_can(monkeypatch):
    """On the CPU the kernel runs only under TRITON_INTERPRET=1; elsewhere the torch pass (same result)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fw.uses_triton("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)       # fake CUDA tensors: the torch pass
    assert not fw.uses_triton("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fw.uses_triton("cuda", torch.bfloat16) and not fw.uses_triton("cuda", torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fw.uses_triton("cpu")
    calls = []
    monkeypatch.setattr(fw, "source_winner_triton", lambda *a, **kw: calls.append("triton") or ("t", "t"))
    monkeypatch.setattr(fw, "source_winner_torch", lambda *a, **kw: calls.append("torch") or ("c", "c"))
    q, k, n = inputs(1, 2, 2, 8, 4)
    fw.source_winner(q, k, n, scale=1.0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fw.source_winner(q, k, n, scale=1.0)
    assert calls == ["triton", "torch"]


@pytest.mark.parametrize("bad, message", [
    (dict(k=torch.zeros(1, 3, 8, 4)), "multiple of Hkv"),
    (dict(n=torch.zeros(1, 3, 8)), "v_norm must be"),
    (dict(q=torch.zeros(1, 2, 9, 4)), "more queries"),
    (dict(window=0), "window must be"),
    (dict(softcap=0.0), "softcap must be"),
    (dict(lengths=torch.tensor([3, 4])), "lengths must be"),
    (dict(sinks=torch.zeros(3)), "sinks must be"),
])
def test_bad_arguments_are_refused_before_any_work(bad, message):
    q, k, n = inputs(1, 2, 2, 8, 4)
    q, k, n = bad.pop("q", q), bad.pop("k", k), bad.pop("n", n)
    for fn in (fw.source_winner_torch, fw.source_winner_triton):
        with pytest.raises(ValueError, match=message):
            fn(q, k, n, scale=1.0, **bad)


def slow_values_gradient(q, k, lse, F, *, scale, causal=True, window=None, softcap=None, lengths=None):
    """``Pᵀ F`` from the full float64 map of ``P_ij = exp(s_ij − lse_i)`` on the visible pairs."""
    s, visible = slow_logits(q, k, scale=scale, causal=causal, window=window, softcap=softcap, lengths=lengths)
    P = torch.where(visible, torch.exp(s - lse.double()[..., None]), 0.0)
    return P.transpose(-1, -2) @ F.double()


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("learned-sinks", "gqa-per-query-norms")])
def test_values_gradient_equals_the_float64_map(case, interpret):
    """``PᵀF`` (5 columns: not a multiple of anything) with the rows' own log-sum-exp, by the kernel
    (16-wide tiles) and the torch pass, against the dense float64 product, for every mask option."""
    opt = dict(CASES[case])
    B, H, Hkv, S, d = 2, 6, 2, 53, 24
    q, k, n = inputs(B, H, Hkv, S, d, Q=opt.pop("Q", None), seed=len(case) + 1)
    if "lengths" in opt:
        opt["lengths"] = torch.tensor(opt["lengths"])
    F = torch.randn(B, H, q.shape[2], 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lse = fw.source_winner_torch(q, k, n, scale=0.4, return_lse=True, **opt)[2]
    want = slow_values_gradient(q, k, lse, F, scale=0.4, **opt)
    got = {"triton": fw.values_gradient_triton(q, k, lse, F, scale=0.4, block_m=16, block_n=16, **opt),
           "torch": fw.values_gradient_torch(q, k, lse, F, scale=0.4, block_elements=4 * 16 * S, **opt)}
    for name, x in got.items():
        assert x.shape == (B, H, S, 5) and x.dtype == torch.float64, name
        torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernel_compiles_for_an_h100(dtype, tmp_path, monkeypatch):
    """The device path, without a device: triton's compiler (its bundled ptxas) turns the kernel into
    an sm_90 cubin with every option on (a GPU run, gpu_check.sh, is what shows it right there; the
    interpreter tests above show the same code right on the CPU). The cache goes to ``tmp_path``."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard._elementwise_max, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET was set when triton was imported: its own jit functions are then "
                    "interpreter functions, which no device compiler takes (make test does not set it)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # triton 3.9's default, said (it warns when unset)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fw._triton()
    fn = fw._compiled(fw._winner_kernel, False)
    pointers = dict(Q_ptr=dtype, K_ptr=dtype, LN_ptr="fp32", LEN_ptr="i64", IDX_ptr="i64", BEST_ptr="fp32", LSE_ptr="fp32",
                    MEAN_ptr="fp32")
    consts = dict(CAUSAL=True, HAS_WINDOW=True, SOFTCAP=True, HAS_LENGTHS=True, IEEE=dtype == "fp32", ENTROPY=True,
                  DOT_F32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)
    sig = {a: ("*" + pointers[a] if a in pointers else "constexpr" if a in consts
               else "fp32" if a in ("scale", "softcap") else "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    assert kernel.asm["cubin"].startswith(b"\x7fELF")
    assert ("mma" in kernel.asm["ptx"]) == (dtype == "bf16")    # bf16 on tensor cores; float32 exact (ieee: FMA)
    # the values' gradient PᵀF, F in q's dtype
    fn = fw._compiled(fw._values_grad_kernel, False)
    pointers = dict(Q_ptr=dtype, K_ptr=dtype, LSE_ptr="fp32", F_ptr=dtype, LEN_ptr="i64", OUT_ptr="fp32")
    consts = dict(CAUSAL=True, HAS_WINDOW=True, SOFTCAP=False, HAS_LENGTHS=True, IEEE=dtype == "fp32",
                  DOT_F32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, BLOCK_C=16)
    sig = {a: ("*" + pointers[a] if a in pointers else "constexpr" if a in consts
               else "fp32" if a in ("scale", "softcap") else "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    assert kernel.asm["cubin"].startswith(b"\x7fELF") and ("mma" in kernel.asm["ptx"]) == (dtype == "bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_device_winner_equals_the_float64_map(dtype, test_device):
    """:func:`source_winner` on ``test_device`` (the Triton kernel on cuda under gpu_check.sh, the
    torch pass on the CPU) against the float64 map of the same (rounded) inputs: every row whose top
    two products differ by more than 1e-3 (relative; bf16 logits are accumulated in float32) picks
    the same source, at 64-wide tiles, GQA, a window and soft-capping."""
    B, H, Hkv, S, d = 2, 8, 2, 300, 64
    q, k, n = (x.to(dtype) for x in inputs(B, H, Hkv, S, d, seed=11, dtype=torch.float32))
    n = n.float()
    for opt in (dict(), dict(window=50, softcap=20.0)):
        want_i, want_v = slow_winner(q, k, n, scale=d ** -0.5, **opt)
        s = torch.einsum("bhqd,bhsd->bhqs", q.double(), k.double().repeat_interleave(H // Hkv, 1)) * d ** -0.5
        if "softcap" in opt:
            s = torch.tanh(s / opt["softcap"]) * opt["softcap"]
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        s = s.masked_fill((j > i) | (j <= i - opt.get("window", S)), float("-inf"))
        x = torch.softmax(s, -1) * n.double().repeat_interleave(H // Hkv, 1)[:, :, None, :]
        top2 = x.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 1e-3 * top2[..., 0]
        assert clear.float().mean() > 0.9
        idx, val = fw.source_winner(q.to(test_device), k.to(test_device), n.to(test_device), scale=d ** -0.5, **opt)
        assert idx.device.type == test_device.type
        idx, val = idx.cpu(), val.cpu().double()
        assert torch.equal(idx[clear], want_i[clear]), (opt, (idx[clear] != want_i[clear]).sum())
        torch.testing.assert_close(val, want_v, rtol=1e-3, atol=1e-6)


def test_values_gradient_refuses_mismatched_lse_and_f():
    q, k, _ = inputs(1, 2, 2, 8, 4)
    for lse, F in ((torch.zeros(1, 2, 7), torch.zeros(1, 2, 8, 3)), (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))):
        for fn in (fw.values_gradient_torch, fw.values_gradient_triton):
            with pytest.raises(ValueError, match="lse must be"):
                fn(q, k, lse, F, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_device_values_gradient_equals_the_float64_map(dtype, test_device):
    """:func:`values_gradient` on ``test_device`` (the Triton kernel on cuda under gpu_check.sh) at
    64-wide tiles against the float64 product of the same rounded inputs: relative error within
    float32 rounding, or bf16's for bf16 (P and F multiplied on the tensor cores in bf16)."""
    B, H, Hkv, S, d = 1, 8, 2, 300, 64
    q, k, n = (x.to(dtype) for x in inputs(B, H, Hkv, S, d, seed=13, dtype=torch.float32))
    F = torch.randn(B, H, S, 4, generator=torch.Generator().manual_seed(4)).to(dtype)
    lse = fw.source_winner_torch(q.double(), k.double(), n.double(), scale=d ** -0.5, window=100,
                                 return_lse=True)[2]
    want = slow_values_gradient(q, k, lse, F, scale=d ** -0.5, window=100)
    got = fw.values_gradient(q.to(test_device), k.to(test_device), lse.float().to(test_device), F.to(test_device),
                             scale=d ** -0.5, window=100).cpu().double()
    rel = float((got - want).norm() / want.norm())
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_bf16_kernels_under_the_interpreter_are_within_bf16_rounding(interpret):
    """Both Triton kernels in bf16 under the interpreter (whose ``tl.dot`` multiplied bf16's stored
    bit patterns as integers: ``fused_winner.INTERPRETER_BF16_DOT``) against float64 on the same
    bf16-rounded inputs. ``PᵀF``: every entry within one bf16 rounding of ``P`` (2⁻⁷ relative: the
    interpreter truncates; docs/precision.md's bf16 bound is one rounding) of ``Pᵀ|F|``, plus float32
    slack for the logits; the winner: the float64 winner on every row whose top two differ by 1e-3,
    its value to 1e-3 relative. GQA, a window and padding; several key and query tiles."""
    B, H, Hkv, S, d = 2, 4, 2, 70, 32
    q, k, n = (x.to(torch.bfloat16) for x in inputs(B, H, Hkv, S, d, seed=5, dtype=torch.float32))
    F = torch.randn(B, H, S, 3, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    opt = dict(window=40, lengths=torch.tensor([70, 51]))
    lse = fw.source_winner_torch(q.double(), k.double(), n.double(), scale=d ** -0.5, return_lse=True, **opt)[2]
    want = slow_values_gradient(q, k, lse, F, scale=d ** -0.5, **opt)
    bound = slow_values_gradient(q, k, lse, F.abs(), scale=d ** -0.5, **opt) * (2 ** -7 + 1e-5) + 1e-6
    got = fw.values_gradient_triton(q, k, lse.float(), F, scale=d ** -0.5, block_m=16, block_n=16, **opt)
    assert got.dtype == torch.float32
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) < 0.05 * float(want.abs().max())          # the interpreter's bit-pattern product: ~1e10

    idx, val = fw.source_winner_triton(q, k, n.float(), scale=d ** -0.5, block_m=16, block_n=16, **opt)
    want_i, want_v = slow_winner(q, k, n.float(), scale=d ** -0.5, **opt)
    top2 = _masked_products(q, k, n.float(), scale=d ** -0.5, **opt).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3 * top2[..., 0]
    assert clear.float().mean() > 0.9 and idx.shape == want_i.shape
    assert torch.equal(idx[clear], want_i[clear])
    torch.testing.assert_close(val.double(), want_v, rtol=1e-3, atol=1e-6)


def _masked_products(q, k, n, *, scale, window=None, lengths=None):
    """``a_ij n_j`` of the float64 causal map (window, right padding): ``[B, H, Q, S]``."""
    q, k, n = q.double(), k.double(), n.double()
    H, S = q.shape[1], k.shape[2]
    s = torch.einsum("bhqd,bhsd->bhqs", q, k.repeat_interleave(H // k.shape[1], 1)) * scale
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    hidden = (j > i) | (j <= i - (window or S))
    if lengths is not None:
        hidden = hidden | (j >= lengths.view(-1, 1, 1, 1))
    a = torch.softmax(s.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0)
    return a * n.repeat_interleave(H // n.shape[1], 1)[:, :, None, :]
