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
