"""The papers' seed architectures at full width (tests/seed_configs.py), random weights, 2 decoder
layers, bf16 on CPU: capture is exact and the metric invariants hold.

For each architecture, one forward with the module's own attention (SDPA; eager for Gemma-2's
soft-capping) and one under analysis, both with hooks on every ``o_proj`` input. Checked:

- the o_proj input the module computed under analysis is rebuilt from the captured pieces
  (``Σ_j a_ij^h v_j^h``, float32) to bf16 rounding (relative error below one bf16 ulp, 2^-8);
- at layer 0 (where both forwards see the same input) the o_proj input of the module's own
  attention is rebuilt to within a few bf16 ulps (SDPA and eager round at other places);
- logits with analysis on are bit-identical (on CPU) to the plugin's exact path with no observer
  (the observers change nothing) and agree with the module's own forward to bf16 rounding;
- ``Σ_j c_ij^h = 1`` and ``Σ_h Σ_j C_ij^h = 1`` on every block (float32 metric math);
- with a sliding window, no query attends to a source ``window`` or more positions back, and
  blocks of late queries do not even compute the sources before their window.

The checks run block by block inside an observer, so T > 4096 (Mistral's window) needs no T x T map.
"""

from __future__ import annotations

import time

import pytest
import torch

from attngeom.capture.session import Session
from attngeom.streaming.reducers import InputBatch, Reducer
from attngeom.streaming import forward
from seed_configs import SEED_NAMES, random_ids, reference_implementation, seed_config, seed_model
from checks import RebuiltOutputs, o_proj_inputs as capture_o_proj_inputs

BF16_ULP = 2.0**-8

# relative Frobenius error allowed: rebuilt vs the o_proj input under analysis (rounding to bf16
# only), and vs the module's own attention at layer 0 (another kernel, other rounding points)
REBUILD_TOL = BF16_ULP
OWN_LAYER0_TOL = 4 * BF16_ULP
# logits with analysis vs the module's own forward (2 layers of bf16 rounding differences)
LOGITS_REL_TOL = 0.05


class CheckBlocks(RebuiltOutputs, Reducer):
    """Rebuilds every layer's o_proj input from the blocks and checks the invariants as it goes."""

    def __init__(self, T: int, window_of: dict[int, int | None]):
        super().__init__(T)
        self.window_of = window_of
        self.max_outside = 0.0
        self.max_row_sum_dev = 0.0
        self.late_blocks_skipping = 0
        self.blocks = 0

    def observe(self, block) -> None:
        self.blocks += 1
        super().observe(block)
        self.max_row_sum_dev = max(self.max_row_sum_dev, float((block.a.sum(-1) - 1).abs().max()))
        window = self.window_of.get(block.layer)
        qi = block.q_positions[:, None]
        kj = block.k_positions[None, :]
        outside = kj > qi
        if window is not None:
            outside = outside | ((qi - kj) >= window)
            if block.q_start >= window and block.k_start > 0:
                self.late_blocks_skipping += 1
        if outside.any():
            self.max_outside = max(self.max_outside, float(block.a[..., outside].abs().max()))


def _o_proj_inputs(adapter, run, tokens):
    """Every layer's o_proj input of the first row, float32 on the CPU (:func:`checks.o_proj_inputs`)."""
    seen, out = capture_o_proj_inputs(adapter, run, tokens)
    return {layer: x[0].float().cpu() for layer, x in seen.items()}, out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def _windows(config) -> dict[int, int | None]:
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    win = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":  # Mistral's window applies to every layer
        return {i: win for i in range(n)}
    return {i: (win if t == "sliding_attention" else None) for i, t in enumerate(types)}


def check_architecture(name: str, T: int, *, bitwise: bool = False, threads: int | None = None,
                       block_elements: int | None = None, device: str | torch.device = "cpu", **overrides) -> dict:
    """Build ``name`` (2 layers, bf16; ``overrides``: configuration fields), run the checks at length
    ``T``, return the figures."""
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    handle = seed_model(name, device=device, **overrides)
    model, cfg = handle.model, handle.model.config
    assert model.dtype == torch.bfloat16
    ids = random_ids(cfg.vocab_size, T).to(device)
    batch = InputBatch(ids=ids[None].cpu(), lengths=torch.tensor([T]), index=[0])
    t_build = time.perf_counter() - t0
    with torch.no_grad():
        own, ref = _o_proj_inputs(handle.adapter, lambda: model(ids[None], use_cache=False).logits.float().cpu(), T)
    checker = CheckBlocks(T, _windows(cfg))
    session = Session(observers=[checker], block_elements=block_elements)
    under, got = _o_proj_inputs(handle.adapter, lambda: forward(handle, batch, session, logits=True).cpu(), T)
    assert session.layers_seen == [0, 1]
    assert model.config._attn_implementation == reference_implementation(cfg)
    figures = {"build_s": t_build, "total_s": None, "T": T}
    for layer in (0, 1):
        rebuilt = checker.rebuilt[layer]
        figures[f"rebuild_rel_{layer}"] = _rel(rebuilt, under[layer])
        assert figures[f"rebuild_rel_{layer}"] < REBUILD_TOL, (name, layer, figures)
    figures["own_layer0_rel"] = _rel(checker.rebuilt[0], own[0])
    assert figures["own_layer0_rel"] < OWN_LAYER0_TOL, (name, figures)
    figures["logits_rel"] = _rel(got, ref)
    assert figures["logits_rel"] < LOGITS_REL_TOL, (name, figures)
    assert torch.isfinite(got).all()
    if bitwise:
        plain = forward(handle, batch, Session(block_elements=block_elements), logits=True).cpu()
        if torch.device(device).type == "cpu":
            assert torch.equal(plain, got), "observers changed the forward pass"
        else:  # GPU kernels need not be bitwise reproducible from one call to the next
            assert torch.allclose(plain, got, rtol=1e-3, atol=1e-3), "observers changed the forward pass"
    figures.update(sum_c=checker.max_sum_c, sum_C=checker.max_sum_C, outside=checker.max_outside,
                   row_sum=checker.max_row_sum_dev, blocks=checker.blocks,
                   late_blocks_skipping=checker.late_blocks_skipping)
    assert checker.max_sum_c < 1e-4, figures
    assert checker.max_sum_C < 1e-4, figures
    assert checker.max_outside == 0.0, figures
    assert checker.max_row_sum_dev < 1e-2, figures  # bf16-rounded probabilities, as the model used them
    figures["total_s"] = time.perf_counter() - t0
    return figures


def test_llama31_8b_two_layers_default_suite(test_device):
    """LLaMA-3.1-8B width (rope "llama3", GQA 32/8), short input: runs in the default suite (and on
    cuda under benchmarks/gpu_check.sh)."""
    f = check_architecture("llama3.1-8b", T=192, bitwise=True, block_elements=1 << 18, device=test_device)
    assert f["blocks"] >= 8  # several blocks of queries per layer


SEED_T = 256
"""Tokens per input of the full-width checks. Their cost is the bf16 matrix products of two
7-9B-wide layers (several times slower on a CPU without AVX-512 than in float32), linear in ``T``;
the checks do not depend on it beyond having several blocks of queries per layer (below)."""


def blocks_of(name: str, T: int, blocks: int = 4) -> int:
    """A ``block_elements`` budget that splits ``T`` queries into about ``blocks`` blocks per layer."""
    return seed_config(name).num_attention_heads * T * T // blocks


@pytest.mark.slow
@pytest.mark.parametrize("name", SEED_NAMES)
def test_seed_architecture_at_full_width(name, test_device):
    f = check_architecture(name, T=SEED_T, block_elements=blocks_of(name, SEED_T), device=test_device)
    assert f["blocks"] >= 2 * 3, f  # two layers, several blocks of queries each
    print(name, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in f.items()})


@pytest.mark.slow
def test_mistral_beyond_its_sliding_window(test_device):
    """Beyond the sliding window: queries past it do not see the first tokens (not even the BOS
    sink), and the blocks of those queries compute only their window. Mistral's layers at full
    width with its window set to 128 and T = 320: the same masks and blocks as its 4096 window at
    T = 4608 (which, in bf16 on a CPU without AVX-512, takes many minutes), at a fourteenth of the length."""
    T = 320
    f = check_architecture("mistral-7b-v0.1", T=T, device=test_device, sliding_window=128,
                           block_elements=blocks_of("mistral-7b-v0.1", T, blocks=5))
    assert f["T"] > 128
    assert f["late_blocks_skipping"] > 0, f
    print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in f.items()})
