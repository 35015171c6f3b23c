"""Checks shared by the test tiers: hooks that read what a model computes without attngeom, the
equality of two traces, input files written for a test, and the repository's scripts loaded as
modules."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch


def o_proj_inputs(adapter, run, tokens: int):
    """Run ``run()`` and return, by attention layer, the input ``[B, T, H*d]`` of the module the
    adapter found as that layer's output projection, whatever it is called (its first call with
    ``tokens`` positions: reads of the projection as an affine map, ``adapter.Projection``, have
    other shapes)."""
    seen, hooks = {}, []

    def hook(layer):
        def record(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            if x.shape[-2] == tokens:
                seen.setdefault(layer, x.detach().clone())
        return record

    for layer in range(adapter.num_layers):
        hooks.append(adapter.o_proj(layer).register_forward_pre_hook(hook(layer), with_kwargs=True))
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return seen, out


class RebuiltOutputs:
    """Observer that rebuilds each layer's output-projection input ``rebuilt[layer] [T, H*d]``
    (float32, on the CPU) from the blocks' head outputs, and keeps the worst deviations of
    ``Σ_j c_ij^h`` (``max_sum_c``) and ``Σ_h Σ_j C_ij^h`` (``max_sum_C``) from one. ``live``: rows
    whose head output has a squared norm at or below it are left out of ``max_sum_c`` (their
    contributions are 0/0); None keeps every row. Subclasses add their checks to :meth:`observe`."""

    def __init__(self, T: int, live: float | None = None):
        self.T, self.live = T, live
        self.rebuilt: dict[int, torch.Tensor] = {}
        self.max_sum_c = 0.0
        self.max_sum_C = 0.0

    def observe(self, block) -> None:
        u = block.head_output[0]                                   # [H, Q, d]
        H, Q, d = u.shape
        if block.layer not in self.rebuilt:                        # allocated once per layer
            self.rebuilt[block.layer] = torch.zeros(self.T, H * d)
        self.rebuilt[block.layer][block.q_start:block.q_start + Q] = u.transpose(0, 1).reshape(Q, H * d).float().cpu()
        dev = (block.contribution.sum(-1) - 1).abs()               # [B, H, Q]
        if self.live is not None:
            dev = dev * (block.head_output_sq > self.live)
        self.max_sum_c = max(self.max_sum_c, float(dev.max()))
        self.max_sum_C = max(self.max_sum_C, float((block.contribution_inter.sum((1, 3)) - 1).abs().max()))


METRICS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")
"""The five token-importance maps of SPEC §2."""


def metric_error(got: np.ndarray, want: np.ndarray, name: str) -> float:
    """Max error, relative to the map's scale for the unnormalised value_weighted (norms ~10)."""
    err = float(np.abs(got - want).max())
    return err / max(1.0, float(np.abs(want).max())) if name == "value_weighted" else err


ACCESSORS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter",
             "value_norm", "head_output_norm", "output_norm", "head_share")


def assert_same_trace(tr, back):
    """Two traces hold the same tokens, layers, metric maps, factors and token scores, bit for bit."""
    assert back.tokens == tr.tokens and back.ids == tr.ids and back.model_name == tr.model_name
    assert [lt.index for lt in back.layers] == [lt.index for lt in tr.layers]
    for a, b in zip(tr.layers, back.layers):
        for name in ACCESSORS:
            assert np.array_equal(getattr(a, name), getattr(b, name)), (a.index, name)
        for k, x in a.factors().items():
            assert np.array_equal(x, b.factors()[k]), (a.index, k)
        for m in ("attention", "value_weighted", "output_normalized", "contribution"):
            assert np.array_equal(a.token_score(m), b.token_score(m)), (a.index, m)


def write_jsonl(path, rows):
    """``rows`` (dicts) as one JSON object a line in ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_script(path: Path, name: str | None = None):
    """The script at ``path`` (a benchmark, a tool) loaded as a module named ``name`` (default: its
    file's stem), without putting its folder on the import path."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
