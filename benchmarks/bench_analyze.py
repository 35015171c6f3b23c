#!/usr/bin/env python
"""Benchmark of ``attngeom`` analysis against plain forward passes and a naive decomposition.

Measured side by side in one run on the default model (``load_model("smollm2-135m")``, float32,
CPU), with the methods alternating within every repeat (the order rotates from one repeat to the
next), so that load from other jobs on a shared machine hits every method alike:

``sdpa``
    a plain forward pass with ``attn_implementation="sdpa"``, transformers' default: the forward
    users compare with (the performance targets are ratios to it).
``eager``
    a plain forward pass with ``attn_implementation="eager"``.
``capture``
    the attngeom forward (blocked exact attention) with no observer: the floor of every analysis.
``attention_stats``
    streaming attention-level statistics only: ``HeadStats(fields=("sink_rate", "self_attention",
    "entropy"))`` and ``TokenStats(metrics=("attention",), columns=("sink_rate", "entropy"))``;
    these never touch a head-space product (tests/unit/test_registry.py checks it).
``eager_attn``
    the same with ``output_attentions=True`` (every layer's ``[H, T, T]`` map is kept).
``analyze``
    :func:`attngeom.streaming.passes.stream` with :class:`~attngeom.streaming.reducers.HeadStats` and
    :class:`~attngeom.streaming.reducers.TokenStats` on all layers. Between them they use all five metric
    maps of SPEC §2 (attention, value_weighted, output_normalized, contribution,
    contribution_inter) on every block of every layer.
``analyze_fused`` / ``analyze_block`` / ``attention_stats_fused`` / ``attention_stats_block``
    the same two analyses with the capture's route forced (``Session(route=...)``, SPEC §10, issue
    49): ``fused`` computes every statistic the reducers ask for from fused attention kernels (a
    forward with ``[v | k]`` as values and its log-sum-exp, the values' gradient ``PᵀF``, the fused
    source winner) without any ``[H, Q, S]`` block; ``block`` is the blocked path. ``analyze`` and
    ``attention_stats`` take the default route, ``auto`` (per device).
``naive``
    what decomposition tools usually do: an eager forward with ``output_attentions=True`` and the
    value states captured by hooks, then, per layer and head, the model-space vectors
    ``a_ij^h ṽ_j^h`` are materialised for every (query, source) pair (a ``[T, T, D]`` tensor per
    head) and projected on ``o_i^h`` and ``o_i`` to get the same five maps. It is run at the first
    size only, on ``--naive-layers`` layers; the per-layer cost is measured and extrapolated
    linearly to all layers (the output says so).

Every measurement runs in a fresh Python process (``--worker``): it loads the model, runs a short
warm-up forward, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), then times the
measured call and reads the peak resident set size (``VmHWM``; the whole process, model weights
included). All forward passes compute the logits of the last position only (``logits_to_keep=1``),
as ``analyze`` does, so that no method pays for ``[T, V]`` logits. Each process uses one torch
thread by default (``--threads``): on a machine shared with other jobs, several OpenMP threads per
process oversubscribe the cores and every operation waits for its slowest thread, which makes the
timings erratic.

Then the longest input: the peak memory of streaming ``analyze`` at T=4096, 8192 and 16384, on the
model cut to its first layer(s). Streaming keeps no per-layer maps, so what a full model adds is
each further layer's weights and its small O(T) summaries: the per-layer slope is measured (1 vs 2
layers) and extrapolated linearly to all 30 layers (with ``--memory-fast`` the longest size runs 1
layer only and the slope of the next size is scaled by the length ratio). The output says which
figures are measured and which are extrapolated. T=16384 is longer than SmolLM2's trained context (8192 tokens): it is run only to
measure memory (``attngeom analyze`` itself refuses it without ``--window``).

Usage::

    python benchmarks/bench_analyze.py              # T=512, 2048, 8192; all cores and 1 thread
    python benchmarks/bench_analyze.py --sizes none --long 32768 --threads 1   # measured long run
    python benchmarks/bench_analyze.py --quick      # T=512 only, 1 repeat, no long-input sizes
    python benchmarks/bench_analyze.py --sizes 512,1024 --repeats 2 --json out/bench.json
    # the routes at 2k, 8k and 32k (32k: the model cut to 2 layers; eager is skipped where its
    # [H, T, T] map of one layer does not fit in memory)
    python benchmarks/bench_analyze.py --sizes 2048,8192,32768 --layers 2 --threads 1 --repeats 1 \
        --methods sdpa,eager,analyze,analyze_fused,analyze_block,attention_stats_fused,attention_stats_block
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("sdpa", "eager", "eager_attn", "capture", "attention_stats", "attention_stats_fused",
           "attention_stats_block", "analyze", "analyze_fused", "analyze_block", "naive")
ROUTED = {"analyze_fused": ("analyze", "fused"), "analyze_block": ("analyze", "block"),
          "attention_stats_fused": ("attention_stats", "fused"), "attention_stats_block": ("attention_stats", "block")}
"""Methods that force the capture's route: ``{method: (analysis, route)}``."""
MAPS = ("eager", "eager_attn", "naive")
"""Methods whose forward holds a layer's ``[H, T, T]`` float32 attention map."""
DEFAULT_METHODS = "sdpa,eager,capture,attention_stats,analyze"
ATTENTION_FIELDS = ("sink_rate", "self_attention", "entropy")
GiB = 1024**3


# ----------------------------------------------------------------------------------------------
# Worker: one measurement in a fresh process
# ----------------------------------------------------------------------------------------------


def _rss_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    hwm = _rss_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _bench_ids(handle, T: int) -> list[int]:
    """``T`` token ids: BOS, then the built-in sample text repeated (content does not change cost)."""
    from attngeom.data.corpora import SAMPLE_TEXT

    body = handle.encode(SAMPLE_TEXT)
    bos = body[0] if handle.tokenizer.bos_token_id is not None else None
    if bos is not None:
        body = body[1:]
    ids = [] if bos is None else [bos]
    while len(ids) < T:
        ids.extend(body)
    return ids[:T]


def _truncate_layers(handle, n: int) -> None:
    """Keep only the first ``n`` decoder layers (for the long-input memory probe)."""
    model = handle.model
    inner = model.model
    inner.layers = inner.layers[:n]
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "num_hidden_layers"):
            cfg.num_hidden_layers = n
            if getattr(cfg, "layer_types", None):
                cfg.layer_types = cfg.layer_types[:n]


def _naive_layer(a, v, w_o, num_heads):
    """Five maps of one layer the naive way: ``a [H, T, T]``, ``v [H, T, d]`` (per query head),
    ``w_o [D, H*d]``. Materialises ``a_ij^h ṽ_j^h`` (``[T, T, D]``) for every head."""
    import torch

    H, T, _ = a.shape
    D = w_o.shape[0]
    W = w_o.t().reshape(H, -1, D)                      # W_O^h: [H, d, D]
    vt = torch.einsum("htd,hdD->htD", v, W)            # ṽ_j^h: [H, T, D]
    # o_i = Σ_h Σ_j a_ij^h ṽ_j^h, needed before the per-head projections
    o_heads = [a[h] @ vt[h] for h in range(H)]          # o_i^h (a product; no per-pair vectors yet)
    o = torch.stack(o_heads).sum(0)                    # o_i
    out = {"attention": a}
    vn = vt.norm(dim=-1)                               # ‖ṽ_j^h‖ [H, T]
    out["value_weighted"] = a * vn[:, None, :]
    contrib, contrib_inter, onorm = [], [], []
    o2 = (o * o).sum(-1)                               # ‖o_i‖²
    for h in range(H):
        x = a[h][:, :, None] * vt[h][None, :, :]       # a_ij^h ṽ_j^h: [T(query), T(source), D]
        oh = o_heads[h]
        on2 = (oh * oh).sum(-1)
        contrib.append((x * oh[:, None, :]).sum(-1) / on2.clamp_min(1e-30)[:, None])
        contrib_inter.append((x * o[:, None, :]).sum(-1) / o2.clamp_min(1e-30)[:, None])
        onorm.append(on2.sqrt())
        del x
    out["contribution"] = torch.stack(contrib)
    out["contribution_inter"] = torch.stack(contrib_inter)
    out["output_normalized"] = out["value_weighted"] / torch.stack(onorm).clamp_min(1e-30)[:, :, None]
    return out


def worker(method: str, T: int, layers: int | None, naive_layers: int, threads: int | None = None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)

    from attngeom.model import load_model
    from attngeom.streaming.reducers import HeadStats, InputBatch, TokenStats
    from attngeom.streaming.passes import forward
    from attngeom.capture.session import Session

    torch.manual_seed(0)
    handle = load_model("smollm2-135m", dtype="float32", device="cpu")
    model = handle.model
    if layers is not None:
        _truncate_layers(handle, layers)
    L = handle.num_layers
    ids = _bench_ids(handle, T)
    x = torch.tensor([ids])
    warm = torch.tensor([ids[:16]])
    result: dict = {"method": method, "T": T, "layers": L, "threads": torch.get_num_threads()}

    if method in ("eager", "eager_attn", "naive"):
        model.set_attn_implementation("eager")
    if method == "sdpa":
        model.set_attn_implementation("sdpa")
    analysis, route = ROUTED.get(method, (method, None))
    if analysis in ("analyze", "attention_stats", "capture"):
        sessions = []

        def session(reducers):
            if route is None:
                sessions.append(Session(observers=reducers))
                return sessions[-1]
            try:
                sessions.append(Session(observers=reducers, route=route))
            except TypeError as e:        # an attngeom from before the routes (issue 49)
                raise SystemExit(f"{method}: this attngeom's Session takes no route ({e})") from None
            return sessions[-1]

        def make():
            if analysis == "analyze":
                return [HeadStats(), TokenStats()]
            if analysis == "attention_stats":
                return [HeadStats(fields=ATTENTION_FIELDS),
                        TokenStats(metrics=("attention",), columns=("sink_rate", "entropy"))]
            return []

        def run():
            batch = InputBatch(ids=x, lengths=torch.tensor([T]), index=[0])
            reducers = make()
            for r in reducers:
                r.begin(batch)
            forward(handle, batch, session(reducers))  # = stream(), without its context-length check
            for r in reducers:
                r.end(batch)
            return [r.result() for r in reducers]
        # warm-up through the same path, on a short input
        wb = InputBatch(ids=warm, lengths=torch.tensor([warm.shape[1]]), index=[0])
        wr = make()
        for r in wr:
            r.begin(wb)
        forward(handle, wb, session(wr))
    elif method in ("eager", "eager_attn", "sdpa"):
        def run():
            with torch.no_grad():
                return model(input_ids=x, use_cache=False, logits_to_keep=1,
                             output_attentions=(method == "eager_attn"))
        with torch.no_grad():
            model(input_ids=warm, use_cache=False, logits_to_keep=1)
    elif method == "naive":
        values: dict[int, torch.Tensor] = {}
        attn_layers = [m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj")]
        hooks = []
        for i, m in enumerate(attn_layers):
            def hook(mod, inp, out, i=i):
                values[i] = out.detach()
            hooks.append(m.v_proj.register_forward_hook(hook))
        H, Hkv, d = handle.num_heads, handle.num_kv_heads, handle.head_dim
        n_naive = min(naive_layers, L)

        def run():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(input_ids=x, use_cache=False, logits_to_keep=1, output_attentions=True)
            t_forward = time.perf_counter() - t0
            per_layer = []
            maps = None
            for li in range(n_naive):
                t1 = time.perf_counter()
                a = out.attentions[li][0].float()                                 # [H, T, T]
                v = values[li][0].view(T, Hkv, d).transpose(0, 1)                 # [Hkv, T, d]
                v = v.repeat_interleave(H // Hkv, dim=0).float()                  # [H, T, d]
                w_o = attn_layers[li].o_proj.weight.detach().float()
                with torch.no_grad():
                    maps = _naive_layer(a, v, w_o, H)
                per_layer.append(time.perf_counter() - t1)
                del maps
            return {"forward_s": t_forward, "per_layer_s": per_layer}
        with torch.no_grad():
            model(input_ids=warm, use_cache=False, logits_to_keep=1, output_attentions=True)
    else:
        raise SystemExit(f"unknown method {method}")

    base = _rss_bytes("VmRSS")
    reset = _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    out = run()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    result.update(seconds=elapsed, cpu_seconds=cpu, peak_bytes=_peak_bytes(), base_bytes=base, peak_reset=reset)
    taken = getattr(sessions[-1], "routes", None) if analysis in ("analyze", "attention_stats", "capture") else None
    if taken:                             # the route each layer took (the capture's record), counted
        result["routes_taken"] = {r: list(taken.values()).count(r) for r in sorted(set(taken.values()))}
    if method == "naive":
        per = out["per_layer_s"]
        result["naive_layers_measured"] = len(per)
        result["naive_forward_s"] = out["forward_s"]
        result["naive_per_layer_s"] = statistics.mean(per)
        result["seconds_measured"] = elapsed
        # all layers: the forward pass plus the measured per-layer cost times the layer count
        result["seconds"] = out["forward_s"] + statistics.mean(per) * L
        result["extrapolated"] = len(per) < L
    return result


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


THREADS = 1


def measure(method: str, T: int, *, layers: int | None = None, naive_layers: int = 2,
            timeout: float | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--T", str(T),
           "--naive-layers", str(naive_layers)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    env = dict(os.environ, TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    cmd += ["--threads", str(THREADS)]          # 0: torch's default (all cores)
    if THREADS:
        env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{method} at T={T} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    res["process_wall_s"] = wall
    # cross-check: the kernel's own record of the child's peak (all children so far: a lower bound
    # of nothing, an upper bound of everything; reported only)
    res["children_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return res


def _available() -> int:
    """Memory available to a new process (``MemAvailable``; all of it where /proc says nothing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _map_fits(T: int) -> bool:
    """Whether an eager forward's attention maps fit: about three ``[9, T, T]`` float32 maps of one
    layer (scores, weights and their cast) within the available memory."""
    return 3 * 9 * T * T * 4 <= _available()


def fmt_s(x: float) -> str:
    return f"{x:8.2f} s"


def fmt_gb(x: float) -> str:
    return f"{x / GiB:6.2f} GiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="T=512 only, 1 repeat, no long-input probe")
    p.add_argument("--sizes", default=None,
                   help="comma-separated input lengths for the timing table (default 512,2048,8192; 'none' to skip it)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per method and size (default 3; --quick 1)")
    p.add_argument("--naive-layers", type=int, default=2, help="layers the naive method computes (default 2)")
    p.add_argument("--memory-sizes", default="",
                   help="lengths for the longest-input probe, on the model cut to its first layers (default none; e.g. 4096,8192,16384)")
    p.add_argument("--memory-layers", default="1,2",
                   help="two layer counts for the per-layer memory slope (default 1,2); the longest size runs "
                        "the first count only")
    p.add_argument("--memory-full-at", default="4096",
                   help="also measure streaming analyze on ALL layers at these lengths, to check the extrapolation "
                        "(default 4096; '' to skip)")
    p.add_argument("--memory-fast", action="store_true",
                   help="run the longest probe size on the first layer count only (slope extrapolated)")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    p.add_argument("--threads", default="0,1",
                   help="torch threads per measurement, comma-separated; 0 = torch's default, all cores "
                        "(default 0,1: all cores, what a user has, and 1 thread, the steadiest on a shared machine)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"methods to time (default {DEFAULT_METHODS}; also eager_attn, naive)")
    p.add_argument("--big-from", type=int, default=8192,
                   help="from this length on, run --big-methods with --big-repeats (default 8192)")
    p.add_argument("--big-methods", default=None, help="methods at long lengths (default: --methods)")
    p.add_argument("--big-repeats", type=int, default=1, help="repeats at long lengths (default 1)")
    p.add_argument("--long", default="",
                   help="after the table, measure streaming analyze on ALL layers at these lengths (e.g. 32768): "
                        "peak memory and duration, measured")
    # worker mode (internal)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None,
                   help="cut the model to its first N decoder layers for the timing table (default all 30; "
                        "a quick check at long lengths)")
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.T, args.layers, args.naive_layers, int(args.threads))))
        return 0
    global THREADS
    threads_list = [int(t) for t in str(args.threads).split(",") if t.strip()]

    size_text = args.sizes or ("512" if args.quick else "512,2048,8192")
    sizes = [] if size_text.strip().lower() == "none" else [int(s) for s in size_text.split(",") if s.strip()]
    repeats = args.repeats or (1 if args.quick else 3)
    mem_sizes = [] if args.quick else [int(s) for s in args.memory_sizes.split(",") if s.strip()]
    mem_layers = [int(s) for s in args.memory_layers.split(",") if s.strip()]
    methods = [m for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method {bad[0]!r}; known: {', '.join(METHODS)}")
    big_methods = [m for m in (args.big_methods or args.methods).split(",") if m.strip()]

    import torch

    print(f"attngeom analyze benchmark — {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads per measurement "
          f"{', '.join('all cores' if t == 0 else str(t) for t in threads_list)}, "
          f"Python {platform.python_version()}")
    print("model: smollm2-135m (SmolLM2-135M-Instruct, 30 layers, 9 heads, 3 KV heads), float32, CPU"
          + (f"; the timing table on its first {args.layers} layer(s) only" if args.layers else ""))
    if sizes:
        print(f"sizes {sizes}, {repeats} repeat(s), methods {methods} alternate within each repeat; absolute "
              "times are noisy on a shared machine, the ratios are the result (wall time, and the process's "
              "CPU time, which waiting for a busy core does not inflate)\n", flush=True)

    records: list[dict] = []
    for th in threads_list:
        THREADS = th
        for T in sizes:
            ms = [m for m in (methods if T < args.big_from else big_methods) if m != "naive" or T == sizes[0]]
            too_big = [m for m in ms if m in MAPS and not _map_fits(T)]
            if too_big:
                print(f"  T={T:5d}: {', '.join(too_big)} skipped: one layer's [9, T, T] float32 map is "
                      f"{9 * T * T * 4 / GiB:.1f} GiB, and eager holds about three ({_available() / GiB:.1f} GiB available)")
                ms = [m for m in ms if m not in too_big]
            for r in range(repeats if T < args.big_from else args.big_repeats):
                order = ms[r % len(ms):] + ms[:r % len(ms)]
                for m in order:
                    try:
                        res = measure(m, T, layers=args.layers, naive_layers=args.naive_layers)
                    except RuntimeError as e:     # one method's failure (e.g. a route this code lacks) is reported
                        print(f"  threads {th} T={T:5d} repeat {r + 1} {m:16s} FAILED: {str(e).splitlines()[-1]}",
                              flush=True)
                        continue
                    res.update(repeat=r, threads_setting=th)
                    records.append(res)
                    extra = (f"  (forward {res['naive_forward_s']:.1f} s + {res['naive_per_layer_s']:.1f} s/layer "
                             f"measured on {res['naive_layers_measured']} layer(s), x{res['layers']} layers)"
                             if m == "naive" else "")
                    if res.get("routes_taken"):
                        extra += "  layers: " + ", ".join(f"{n} {r}" for r, n in res["routes_taken"].items())
                    print(f"  threads {res['threads']} T={T:5d} repeat {r + 1} {m:16s} {fmt_s(res['seconds'])} "
                          f"cpu {fmt_s(res['cpu_seconds'])} peak {fmt_gb(res['peak_bytes'])}{extra}", flush=True)

    # ---- ratio table -------------------------------------------------------------------------
    def stat(th, T, m, key):
        xs = [r[key] for r in records if r["T"] == T and r["method"] == m and r.get("threads_setting") == th
              and r.get("layers_probe") is None]
        return statistics.median(xs) if xs else None

    def ratio(x, y):
        return None if x is None or y is None else x / y

    def fr(x):
        return f"{x:6.2f}x" if x is not None else "     —"

    table = []
    if sizes:
        print("\nMedians over repeats (time of the measured call; peak RSS of the whole process). "
              "Ratios to the SDPA forward and to the eager forward, by wall time and by CPU time:")
        header = (f"{'threads':>7} {'T':>6} {'method':<16} {'wall':>10} {'cpu':>10} {'xSDPA':>7} {'xeager':>7} "
                  f"{'cpu xSDPA':>9} {'cpu xeager':>10} {'peak RSS':>10} {'mem xSDPA':>9}")
        print(header)
        print("-" * len(header))
    for th in threads_list:
        for T in sizes:
            ts, te = stat(th, T, "sdpa", "seconds"), stat(th, T, "eager", "seconds")
            cs, ce = stat(th, T, "sdpa", "cpu_seconds"), stat(th, T, "eager", "cpu_seconds")
            ms_ = stat(th, T, "sdpa", "peak_bytes")
            for m in METHODS:
                t, c, mem = stat(th, T, m, "seconds"), stat(th, T, m, "cpu_seconds"), stat(th, T, m, "peak_bytes")
                if t is None:
                    continue
                row = {"threads": th, "T": T, "method": m, "seconds": t, "cpu_seconds": c, "peak_bytes": mem,
                       "time_vs_sdpa": ratio(t, ts), "time_vs_eager": ratio(t, te),
                       "cpu_vs_sdpa": ratio(c, cs), "cpu_vs_eager": ratio(c, ce), "peak_vs_sdpa": ratio(mem, ms_)}
                table.append(row)
                note = " (extrapolated)" if m == "naive" else ""
                print(f"{'all' if th == 0 else th:>7} {T:>6} {m:<16} {t:>8.2f} s {c:>8.2f} s {fr(row['time_vs_sdpa'])} "
                      f"{fr(row['time_vs_eager'])} {fr(row['cpu_vs_sdpa']):>9} {fr(row['cpu_vs_eager']):>10} "
                      f"{mem / GiB:>6.2f} GiB {fr(row['peak_vs_sdpa']):>9}{note}")
    print()

    targets = []
    th_all = 0 if 0 in threads_list else threads_list[0]
    if 2048 in sizes:
        for m, limit in (("analyze", 1.5), ("attention_stats", 1.2)):
            r_ = ratio(stat(th_all, 2048, m, "seconds"), stat(th_all, 2048, "sdpa", "seconds"))
            if r_ is not None:
                targets.append((f"{m} time <= {limit}x SDPA at T=2048 ({'all cores' if th_all == 0 else th_all})",
                                r_, r_ <= limit))
    if 512 in sizes:
        tn = stat(threads_list[0], 512, "naive", "seconds")
        ta = stat(threads_list[0], 512, "analyze", "seconds")
        if tn is not None and ta is not None:
            targets.append(("analyze >= 50x faster than naive at T=512", tn / ta, tn / ta >= 50))

    for T in [int(x) for x in args.long.split(",") if x.strip()]:
        THREADS = threads_list[0]
        print(f"Long input: streaming analyze (all metrics) on all layers at T={T}", flush=True)
        try:
            res = measure("analyze", T)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"  T={T} failed: {str(e).splitlines()[0]}")
            continue
        res["long"] = True
        records.append(res)
        ok = res["peak_bytes"] <= 16 * GiB
        print(f"  T={T}: peak {fmt_gb(res['peak_bytes'])} (MEASURED, all {res['layers']} layers, "
              f"{'within' if ok else 'OVER'} 16 GiB); {res['seconds']:.0f} s wall, {res['cpu_seconds']:.0f} s CPU, "
              f"{res['threads']} thread(s)", flush=True)
        targets.append((f"T={T} all layers peak memory within 16 GiB (GiB)", res["peak_bytes"] / GiB, ok))

    # ---- longest input ------------------------------------------------------------------------
    probe = []
    if mem_sizes:
        longest = max(mem_sizes)
        n1, n2 = mem_layers[0], mem_layers[-1]
        print(f"Longest input: peak memory of streaming analyze (all metrics) on the model cut to its first "
              f"{n1} and {n2} layer(s)" + (f" (the longest size, {longest}, on {n1} only)" if args.memory_fast else ""),
              flush=True)
        for T in sorted(mem_sizes):
            for nl in ([n1] if T == longest and args.memory_fast and len(mem_sizes) > 1 else sorted({n1, n2})):
                try:
                    res = measure("analyze", T, layers=nl)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"  T={T} on {nl} layer(s) failed: {str(e).splitlines()[0]}")
                    continue
                res["layers_probe"] = nl
                records.append(res)
                probe.append(res)
                print(f"  T={T:6d} {nl:2d} layer(s): {fmt_s(res['seconds'])} peak {fmt_gb(res['peak_bytes'])}",
                      flush=True)
        full_L = 30
        # all layers at a few lengths: a measurement, and the per-layer growth of a real full model
        full = {}
        full_at = [int(x) for x in args.memory_full_at.split(",") if x.strip()] if args.memory_full_at else []
        for T in full_at:
            try:
                res = measure("analyze", T)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  T={T} on all layers failed: {str(e).splitlines()[0]}")
                continue
            res["layers_probe"] = res["layers"]
            full_L = res["layers"]
            records.append(res)
            full[T] = res
            print(f"  T={T:6d} all {res['layers']} layers: {fmt_s(res['seconds'])} peak {fmt_gb(res['peak_bytes'])}",
                  flush=True)
        print(f"\nAll {full_L} layers, per length (MEASURED where a full run was made; otherwise extrapolated from "
              f"the largest-layer probe: + ({full_L} - layers) x per-layer growth, taking the larger of (a) the "
              "probe's own slope between its two layer counts and (b) the growth per layer of the full run at the "
              "longest shorter length, scaled up with the length; both include each layer's weights, ~14 MiB):")
        longest_ok = None
        prev = None  # (T, slope) of the last probe with two layer counts
        for T in sorted(set(mem_sizes) | set(full)):
            rs = {r["layers_probe"]: r for r in probe if r["T"] == T}
            if not rs and T not in full:
                continue
            attn_bytes = full_L * 9 * T * T * 4
            tail = (f"; output_attentions would need {attn_bytes / GiB:.1f} GiB for the maps alone"
                    + (" [longer than the model's trained context: memory probe only]" if T > 8192 else ""))
            if T in full:
                peak_all, t_all, how = full[T]["peak_bytes"], full[T]["seconds"], "MEASURED on all layers"
            else:
                top_n = max(rs)
                top = rs[top_n]
                ests = []
                if len(rs) >= 2:
                    lo_n = min(rs)
                    slope = max(0.0, (top["peak_bytes"] - rs[lo_n]["peak_bytes"]) / (top_n - lo_n))
                    prev = (T, slope)
                    ests.append((slope, f"slope {lo_n} vs {top_n} layers"))
                elif prev is not None:
                    ests.append((prev[1] * T / prev[0], f"slope of T={prev[0]} x{T / prev[0]:.0f}"))
                shorter = [Tc for Tc in full if Tc < T and {r["layers_probe"] for r in probe if r["T"] == Tc} >= {top_n}]
                if shorter:
                    Tc = max(shorter)
                    pc = next(r for r in probe if r["T"] == Tc and r["layers_probe"] == top_n)
                    growth = max(0.0, (full[Tc]["peak_bytes"] - pc["peak_bytes"]) / (full_L - top_n))
                    ests.append((growth * T / Tc, f"full-run growth at T={Tc} x{T / Tc:.0f}"))
                if not ests:
                    continue
                per_layer, src = max(ests)
                peak_all = top["peak_bytes"] + (full_L - top_n) * per_layer
                t_all = top["seconds"] / top_n * full_L  # time per layer x layers (embedding etc. counted each time)
                top["extrapolated_peak_all_layers"] = peak_all
                top["extrapolated_seconds_all_layers"] = t_all
                how = (f"extrapolated from {fmt_gb(top['peak_bytes']).strip()} on {top_n} layer(s) with "
                       f"{per_layer / 2**20:.0f} MiB/layer ({src})")
            ok = peak_all <= 16 * GiB
            if ok:
                longest_ok = T
            print(f"  T={T:6d}: ~{fmt_gb(peak_all)} ({'within' if ok else 'OVER'} 16 GiB), ~{t_all:.0f} s; {how}{tail}")
        if longest_ok is not None:
            targets.append((f"longest input analysed within 16 GiB (probed up to {longest}; extrapolated "
                            f"to all layers)", float(longest_ok), longest_ok >= 16384))

    if targets:
        print("\nTargets:")
        for name, value, ok in targets:
            print(f"  [{'met' if ok else 'MISSED'}] {name}: {value:.2f}")

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"records": records, "table": table,
                                               "targets": [list(t) for t in targets]}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
