"""benchmarks/count_analyze.py's counter on hand-computed cases: calls, the products' floating-point
operations and the bytes each operator addresses (views none, expanded inputs their span, gathers
what they read)."""

from pathlib import Path

import torch
import torch.nn.functional as F

from checks import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "count_analyze.py"


def _count(fn):
    mod = load_script(SCRIPT)
    with torch.inference_mode(), mod.OpCounts() as c:
        fn()
    return c


def test_a_matrix_product_counts_its_flops_and_the_bytes_of_its_operands():
    a, b = torch.ones(4, 3), torch.ones(3, 5)
    c = _count(lambda: a @ b)
    assert c.rows["mm"] == [1, 2 * 4 * 3 * 5, (12 + 15 + 20) * 4]
    assert c.totals() == {"calls": 1, "gflop": 120 / 1e9, "product_gb": 188 / 1e9, "other_gb": 0.0}


def test_a_composite_is_counted_by_what_it_runs_and_a_view_addresses_nothing():
    a, w = torch.ones(4, 3), torch.ones(5, 3)
    c = _count(lambda: F.linear(a, w))                 # linear -> t (a view) + mm
    assert "linear" not in c.rows
    assert c.rows["t"] == [1, 0, 0]
    assert c.rows["mm"][:2] == [1, 120]


def test_an_expanded_input_addresses_its_span_and_a_gather_what_it_reads():
    x, y = torch.ones(1, 5), torch.ones(4, 5)
    c = _count(lambda: x.expand(4, 5) + y)
    assert c.rows["add"] == [1, 0, (5 + 20 + 20) * 4]
    src, idx = torch.ones(2, 1000), torch.zeros(2, 1, dtype=torch.long)
    c = _count(lambda: src.gather(-1, idx))
    assert c.rows["gather"] == [1, 0, 2 * (2 * 4) + 2 * 8]


def test_the_sdpa_kernel_counts_two_products_per_visible_pair():
    q = k = v = torch.ones(1, 2, 4, 8)
    c = _count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    name = "_scaled_dot_product_flash_attention_for_cpu"
    assert c.rows[name][:2] == [1, 4 * 1 * 2 * 8 * (4 * 5 // 2)]
    c = _count(lambda: F.scaled_dot_product_attention(q, k, v))
    assert c.rows[name][1] == 4 * 1 * 2 * 8 * 16


def test_the_sdpa_backward_counts_five_products_per_visible_pair():
    q = k = v = torch.ones(1, 2, 4, 8)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.5)
    name = "_scaled_dot_product_flash_attention_for_cpu_backward"
    c = _count(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        out, q, k, v, out, lse, 0.0, True, scale=0.5))
    assert c.rows[name][:2] == [1, 10 * 1 * 2 * 8 * (4 * 5 // 2)]


def test_each_operator_is_charged_its_roofline_on_every_gpu():
    """``max(flops / peak of the dtype, bytes / bandwidth)`` per operator, summed; a float32
    product at the fp32 peak, a bf16 one at the tensor cores', an element-wise one by its bytes."""
    mod = load_script(SCRIPT)
    gpus = {"slow": {"bf16": 100.0, "fp32": 10.0, "bandwidth": 1000.0}}
    a, b = torch.ones(4, 3), torch.ones(3, 5)
    with torch.inference_mode(), mod.OpCounts(gpus) as c:
        a @ b                                            # 120 flops, 188 bytes
    assert c.launches == 1 and c.gpu_seconds["slow"] == max(120 / 10.0, 188 / 1000.0)
    with torch.inference_mode(), mod.OpCounts(gpus) as c:
        a.bfloat16() @ b.bfloat16()                      # two casts (bytes only), then the product
    casts = (12 * 4 + 12 * 2 + 15 * 4 + 15 * 2) / 1000.0
    assert c.launches == 3 and abs(c.gpu_seconds["slow"] - (casts + max(120 / 100.0, 94 / 1000.0))) < 1e-12
    assert set(mod.GPUS) == {"H100 SXM", "H200 SXM"}
    assert mod.GPUS["H200 SXM"]["bandwidth"] == 4.8e12 and mod.GPUS["H100 SXM"]["bf16"] == 989e12
    assert mod.parse_gpu("x=500,50,2") == ("x", {"bf16": 500e12, "fp32": 50e12, "bandwidth": 2e12})


def test_the_fused_winner_is_counted_as_its_triton_kernel():
    """Under :func:`triton_winner` the winner is one kernel of ``2·d`` FLOPs per visible pair that
    reads q, k and the norms once; the torch pass computing it on the CPU is not counted, and its
    result is returned unchanged."""
    mod = load_script(SCRIPT)
    from attngeom.capture import fused_winner

    g = torch.Generator().manual_seed(0)
    q, k, n = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.rand(1, 2, 6, generator=g)
    want = fused_winner.source_winner(q, k, n, scale=0.5, window=4)
    with torch.inference_mode(), mod.OpCounts() as c, mod.triton_winner(c):
        got = fused_winner.source_winner(q, k, n, scale=0.5, window=4)
    assert fused_winner.source_winner.__name__ == "source_winner"          # restored
    assert fused_winner.values_gradient.__name__ == "values_gradient"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    pairs = 1 + 2 + 3 + 4 + 4 + 4                                          # causal, window 4
    assert dict(c.rows) == {"source_winner (Triton)": [1, 2 * 4 * 8 * pairs, (4 * 6 * 8 + 2 * 6 * 8 + 2 * 6) * 4 + 4 * 6 * 16]}
    assert c.launches == 1


def test_cudas_fused_kernels_count_their_products_by_width():
    """The memory-efficient kernel (what the fused route runs on CUDA) with a value width other than
    the key's: ``2·(dk + dv)`` per visible pair forward, ``2·(3·dk + 2·dv)`` backward (meta tensors)."""
    mod = load_script(SCRIPT)
    q = k = torch.empty(1, 2, 4, 8, device="meta")
    v = torch.empty(1, 2, 4, 16, device="meta")
    with mod.OpCounts() as c:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            out, q, k, v, None, out, lse, seed, offset, 0.0, [False, False, True, False], True)
    pairs = 4 * 5 // 2
    assert c.rows["_scaled_dot_product_efficient_attention"][:2] == [1, 2 * 2 * pairs * (8 + 16)]
    assert c.rows["_scaled_dot_product_efficient_attention_backward"][:2] == [1, 2 * 2 * pairs * (3 * 8 + 2 * 16)]


def test_one_layers_kernels_are_counted_at_any_length_on_meta_tensors():
    """``--layer``: the SDPA forward counts ``4·d`` FLOPs per visible pair and head, the fused
    winner half of that, the block path's winner reads and writes its ``[H, Q, S]`` maps (more
    bytes than all fused kernels together), and every estimate is positive."""
    mod = load_script(SCRIPT)
    T, H, d = 4096, mod.LAYER_SHAPES["smollm2"][0], mod.LAYER_SHAPES["smollm2"][2]
    c = mod.layer_counts("smollm2", T, torch.bfloat16, torch.bfloat16, mod.GPUS)
    flops = {k: sum(r[1] for r in v.rows.values()) for k, v in c.items()}
    moved = {k: sum(r[2] for r in v.rows.values()) for k, v in c.items()}
    pairs = T * (T + 1) // 2
    assert flops["sdpa"] == 4 * d * H * pairs and flops["winner"] == 2 * d * H * pairs
    assert flops["values_gradient"] == 2 * (d + 16) * H * pairs                  # q·k again, Pᵀ F at 16 columns
    assert moved["winner_block"] > moved["attend"] + moved["transpose"] + moved["winner"]
    assert all(v.gpu_seconds[g] > 0 for v in c.values() for g in mod.GPUS)
    assert mod.linear_flops("llama8b", 1) == 2 * (4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336)
