"""benchmarks/gpu_check.sh, and the device-agnostic tests it runs on cuda.

``test_device_*`` run on ``$ATTNGEOM_TEST_DEVICE`` (the ``test_device`` fixture in conftest.py;
cpu by default, cuda under gpu_check.sh): tiny models of several architectures in float32 and
bf16, capture rebuilds the module's own o_proj input, logits with analysis equal the plain exact
path, and the invariants hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attngeom.capture.session import Session
from attngeom.streaming.reducers import InputBatch, Reducer
from attngeom.streaming import forward
from checks import RebuiltOutputs
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    out = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return "GPU" in out.stdout


@pytest.mark.skipif(_gpu_present(), reason="a CUDA device is present: the script would run for real")
def test_gpu_check_fails_fast_without_cuda():
    t = time.perf_counter()
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    elapsed = time.perf_counter() - t
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and "CUDA" in lines[0], out.stderr
    assert out.stdout == ""
    assert elapsed < 10


def test_gpu_check_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_gpu_check_refuses_an_unknown_option():
    out = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["gpu_check: unknown option --fast (the only option is --dry-run)"]


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_part_on_the_cpu():
    """``--dry-run``: the device tests collected, the analysis / SDPA ratios (every route of the
    capture, the block budgets on the block path), the route kernels and the generation benchmark
    run on the CPU at toy sizes with this Python: the script's code runs without a GPU."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("gpu_check: dry run on the CPU")
    assert "gpu_check: device tests collected (run on cuda by the real check)" in lines
    ratios = [x for x in lines if x.strip().startswith("tiny-llama") and "time x" in x and "peak above weights" in x]
    # two lengths with the device's default budget and route, every route at one length, then the
    # budget sweep on the block path
    assert [x.split()[1:7] for x in ratios] == [
        ["T=", "64", "blocks", "default", "route", "default"], ["T=", "128", "blocks", "default", "route", "default"],
        *[["T=", "128", "blocks", "default", "route", r] for r in ("auto", "fused", "block")],
        ["T=", "128", "blocks", "2^12", "route", "block"], ["T=", "128", "blocks", "2^14", "route", "block"]]
    kernels = [x.split() for x in lines if x.strip().startswith("T=") and "the SDPA forward" in x]
    assert [k[2] for k in kernels if k[1] == "128"][:5] == ["sdpa", "attend", "transpose", "winner", "winner_block"]
    assert any(k[1] == "128" and k[2:4] == ["fused", "route"] for k in kernels)
    bench = [x for x in lines if x.startswith("P=    8 N=   2")]
    assert len(bench) == 1 and "generate" in bench[0] and "analyze" in bench[0] and "TOKENS DIFFER" not in bench[0]
    assert any(x.strip().startswith("resident MB after step 1") for x in lines)
    grid = [x.split() for x in lines if x.split()[:1] in (["generate"], ["grid"])]
    assert [g[0] for g in grid] == ["generate", "grid"] and grid[0][2] == "1.00" and float(grid[1][2]) > 0
    assert not any("FAILED" in x for x in lines)
    assert [x.split("'")[1] for x in lines if x.startswith("gpu_check: step '")] == [
        "analysis / SDPA ratios", "route kernels", "generation benchmark", "task grid benchmark"]
    assert lines[-1].startswith("gpu_check: done in ")


class _Collect(RebuiltOutputs, Reducer):
    """The output-projection inputs rebuilt on the host and the contribution sums."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2"])
def test_device_capture_exact(arch, dtype, test_device):
    handle = tiny_model(arch)
    model = handle.model.to(device=test_device, dtype=dtype)
    T = 40
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=g)
    ids[0, 0] = 1
    batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
    seen, hooks = {}, []
    for name, mod in model.named_modules():
        if name.endswith("self_attn"):
            hooks.append(mod.o_proj.register_forward_pre_hook(
                lambda m, args, i=mod.layer_idx: seen.__setitem__(i, args[0].detach()[0].float().cpu())))
    collect = _Collect(T)
    try:
        got = forward(handle, batch, Session(observers=[collect], block_elements=300), logits=True).cpu()
    finally:
        for h in hooks:
            h.remove()
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert sorted(collect.rebuilt) == sorted(seen)
    for layer, rebuilt in collect.rebuilt.items():
        rel = float((rebuilt - seen[layer]).norm() / seen[layer].norm())
        assert rel < tol, (arch, dtype, layer, rel)
    plain = forward(handle, batch, Session(block_elements=300), logits=True).cpu()
    assert torch.allclose(got, plain, rtol=1e-5, atol=1e-5), float((got - plain).abs().max())
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids.to(test_device)).logits.float().cpu()
    ltol = 1e-4 if dtype == torch.float32 else 0.05
    assert float((got - eager).norm() / eager.norm()) < ltol
    assert collect.max_sum_c < 1e-4 and collect.max_sum_C < 1e-4


def _sinks_selection_heads(handle, windows):
    """The tables of ``attngeom sinks`` (statistics and sink removal), ``attngeom selection`` and
    ``attngeom heads`` for ``windows``, streamed in padded batches of two with small blocks. The
    selection's geometry in float64: in float32 its ranks and zero distances move with rounding
    (``SelectionStats``' float32 default; a weight nudged by one float32 step changed 1-5 % of its rows)."""
    from attngeom.heads.taxonomy import TaxonomyStats
    from attngeom.selection.reducer import SelectionStats
    from attngeom.sinks.reducer import SinkStats
    from attngeom.sinks.removal import SourceRemoval
    from attngeom.streaming.passes import stream

    stats, taxonomy, selection, removal = SinkStats(), TaxonomyStats(), SelectionStats(repeats=2, queries=3, dtype=torch.float64), SourceRemoval("sink")
    stream(handle, windows, [stats, taxonomy, selection], intervention=removal, batch_size=2, progress=False,
           block_elements=2000)
    sel, reg = selection.result()
    return {**stats.result(), "removal": removal.result(), "heads": taxonomy.result(), "selection": sel, "regime": reg}


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_device_sinks_selection_and_heads_match_the_cpu(arch, test_device):
    """The sink statistics and removal, the selection geometry, the head taxonomy and the heads'
    weight norms computed on ``test_device`` (float32) equal the CPU's (gpu_check.sh runs this on cuda; tests/device/
    test_fake_device.py checks their devices without a GPU). Gemma 2's sliding window of 8 makes
    the selection read its candidates through the mask; the sink leaves the window."""
    handle = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (40, 27, 33)]
    from attngeom.heads.experiment import weight_norms

    cpu, cpu_weights = _sinks_selection_heads(handle, windows), weight_norms(handle)
    handle.model.to(test_device)
    try:
        dev, dev_weights = _sinks_selection_heads(handle, windows), weight_norms(handle)
    finally:
        handle.model.to("cpu")
    np.testing.assert_allclose(dev_weights, cpu_weights, rtol=1e-5)    # the heads' removal order (attngeom heads)
    assert cpu.keys() == dev.keys()
    # a value within rounding of a bin's edge may fall in the next bin on the device: per bin and
    # for what is read from the histograms (quantiles, extreme bins), most must agree, and every total
    hist = cpu["hist"].groupby(["layer", "head", "quantity"])["count"].sum()
    assert hist.equals(dev["hist"].groupby(["layer", "head", "quantity"])["count"].sum())
    for name in ("curve", "drift"):
        assert cpu[name].groupby(["layer", "head"])["queries"].sum().equals(dev[name].groupby(["layer", "head"])["queries"].sum())
    binned = ("_q10", "_q25", "_median", "_q75", "_q90", "anti_aligned", "interior", "rho_min", "rho_max")
    for name, a in cpu.items():
        if name == "hist":
            continue
        b = dev[name]
        assert list(a.columns) == list(b.columns) and a.shape == b.shape and len(a), name
        for col in a.columns:
            x, y = a[col].to_numpy(), b[col].to_numpy()
            close = (np.isclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True) if x.dtype.kind == "f" else x == y)
            if name in ("curve", "drift") or any(k in col for k in binned):
                want = 0.95
            elif name == "selection":
                want = 0.99            # a top-N can differ where two attentions tie within float32 rounding
            else:
                want = 1.0
            assert close.mean() >= want, (name, col, close.mean())


def test_stand_in_has_the_models_architecture_and_tokenizer_and_random_weights(tmp_path):
    """benchmarks/stand_in.py: ``write`` keeps a model's config and tokenizer (no weights), ``build``
    makes a loadable folder of the same architecture with random weights (what gpu_check.sh times
    where the bundled model's package is not installed)."""
    from attngeom import load_model

    src = tiny_model("llama")
    saved = tmp_path / "model"
    src.model.save_pretrained(saved)
    src.tokenizer.save_pretrained(saved)
    script = str(ROOT / "benchmarks" / "stand_in.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in (["write", str(tmp_path / "cfg"), "--model", str(saved)],
                 ["build", str(tmp_path / "cfg"), str(tmp_path / "out"), "--seed", "1"]):
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert not any(p.suffix == ".safetensors" for p in (tmp_path / "cfg").iterdir())
    stand_in = load_model(str(tmp_path / "out"))
    def public(config) -> dict:
        return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "dtype"}

    assert public(stand_in.model.config) == public(src.model.config)
    assert stand_in.tokenizer.encode("The cat") == src.tokenizer.encode("The cat")
    a = dict(src.model.named_parameters())
    b = dict(stand_in.model.named_parameters())
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])
    out = subprocess.run([sys.executable, script, "build", str(tmp_path / "none"), str(tmp_path / "x")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "holds no config.json" in out.stderr and not (tmp_path / "x").exists()
