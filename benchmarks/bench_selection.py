"""Benchmark: selection geometry (SPEC §5) for all layers and heads against one SDPA (and eager) forward.

One window of each of ``--sizes`` tokens (default 512, 2048, 8192) of the shared WikiText file
(random token ids when the file is missing), with each of ``--threads`` (default all cores, then
1). Timed side by side in one run, alternating, ``--repeats`` times (medians):

- ``eager`` / ``SDPA``: one forward pass of the model with ``attn_implementation="eager"`` / ``"sdpa"``
  (transformers' default, the forward users run anyway), with the logits of the last position only
  (``logits_to_keep=1``), as the selection's own forward computes them: no method pays for the
  ``[T, V]`` logits (were the forwards to compute every position's logits, the LM head's share
  would flatter the selection's ratios);
- ``selection``: :func:`attngeom.streaming.passes.stream` with :class:`attngeom.selection.reducer.SelectionStats` on
  every layer: the captured forward plus, at the last query, every N (1, 2, 4, …, 256 below the
  window), both distances, top-N with and without the sink, 8 random repeats, the sink-aware regime
  parameters (the target's workload); then the command's full default beside it: also 8 random
  repeats drawn without the sink and the sink-aware prediction;
- ``capture``: the same captured forward with no observer (to split the selection's own cost).

Target: ``selection / SDPA <= 1.5``. Run: ``.venv/bin/python benchmarks/bench_selection.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attngeom.capture.session import Session  # noqa: E402
from attngeom.model import load_model  # noqa: E402
from attngeom.streaming.reducers import InputBatch  # noqa: E402
from attngeom.selection import SelectionStats  # noqa: E402
from attngeom.streaming import forward, stream

DATA = Path("/work/shared/data/wikitext-2-raw-test.txt")


def window_ids(handle, tokens: int) -> list[int]:
    if DATA.exists():
        from attngeom.data.corpora import load_windows

        return load_windows(handle, str(DATA), tokens, None, 1)[0]
    g = torch.Generator().manual_seed(0)
    bos = handle.tokenizer.bos_token_id
    ids = torch.randint(10, handle.model.config.vocab_size, (tokens,), generator=g).tolist()
    if bos is not None:
        ids[0] = bos
    return ids


@torch.no_grad()
def time_eager(handle, ids, impl: str = "eager") -> float:
    model = handle.model
    previous = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        x = torch.tensor([ids], device=model.device)
        t = time.perf_counter()
        model(input_ids=x, use_cache=False, logits_to_keep=1)   # as the selection's own forward
        return time.perf_counter() - t
    finally:
        model.set_attn_implementation(previous)


def time_capture(handle, ids) -> float:
    batch = InputBatch(ids=torch.tensor([ids]), lengths=torch.tensor([len(ids)]), index=[0])
    t = time.perf_counter()
    forward(handle, batch, Session(observers=[]))
    return time.perf_counter() - t


def time_selection(handle, ids, repeats: int, predict: bool, random_without_sink: bool) -> tuple[float, SelectionStats]:
    red = SelectionStats(repeats=repeats, predict=predict, random_without_sink=random_without_sink)
    t = time.perf_counter()
    stream(handle, [ids], [red], progress=False)
    return time.perf_counter() - t, red


def measure(handle, ids, rounds: int, random_repeats: int, predict: bool) -> dict:
    """Medians over ``rounds`` of the forwards and the selection, alternating within each round."""
    time_eager(handle, ids[:64])  # warm-up
    eager, sdpa, capture, core, full = [], [], [], [], []
    red = None
    for r in range(rounds):
        eager.append(time_eager(handle, ids))
        sdpa.append(time_eager(handle, ids, "sdpa"))
        capture.append(time_capture(handle, ids))
        t, red = time_selection(handle, ids, random_repeats, predict=False, random_without_sink=False)
        core.append(t)
        if predict:
            t, _ = time_selection(handle, ids, random_repeats, predict=True, random_without_sink=True)
            full.append(t)
        print(f"threads {torch.get_num_threads()} T={len(ids)} round {r}: eager {eager[-1]:.2f}s  SDPA {sdpa[-1]:.2f}s  "
              f"captured forward {capture[-1]:.2f}s  selection {core[-1]:.2f}s"
              + (f"  full default {full[-1]:.2f}s" if full else ""), flush=True)
    sel, _ = red.result()
    med = statistics.median
    return {"T": len(ids), "threads": torch.get_num_threads(), "eager": med(eager), "sdpa": med(sdpa),
            "capture": med(capture), "selection": med(core), "full": med(full) if full else None,
            "rows": len(sel), "ns": sorted(sel["N"].unique().tolist()), "violations": red.violations,
            "selections": red.selections}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="512,2048,8192", help="window lengths (default 512,2048,8192)")
    ap.add_argument("--threads", default="0,1", help="torch threads per setting; 0 = all cores (default 0,1)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds (medians reported; 1 from 8192 tokens)")
    ap.add_argument("--random-repeats", type=int, default=8)
    ap.add_argument("--no-predict", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    handle = load_model(args.model)
    cores = os.cpu_count() or 1
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    print(f"model {handle.name}: {handle.num_layers} layers x {handle.num_heads} heads; last query of one window; "
          f"every N, both distances, top-N with and without the sink, {args.random_repeats} random repeats")
    results = []
    for th in threads:
        torch.set_num_threads(th or cores)
        for T in sizes:
            ids = window_ids(handle, T)
            results.append(measure(handle, ids, args.repeats if T < 8192 else 1, args.random_repeats,
                                   not args.no_predict))
    bad = sum(r["violations"] for r in results)
    print(f"\nbound violations {bad} of {sum(r['selections'] for r in results)} selections")
    print("medians; selection = the captured forward plus the geometry; full = the command's default "
          "(+ random draws without the sink, + the sink-aware prediction)")
    head = (f"{'threads':>7} {'T':>6} {'SDPA s':>8} {'eager s':>8} {'capture s':>9} {'select s':>9} "
            f"{'xSDPA':>6} {'xeager':>6} {'full s':>7} {'full xSDPA':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        full = (f"{r['full']:>7.2f} {r['full'] / r['sdpa']:>9.2f}x" if r["full"] is not None
                else f"{'-':>7} {'-':>10}")
        print(f"{r['threads']:>7} {r['T']:>6} {r['sdpa']:>8.2f} {r['eager']:>8.2f} {r['capture']:>9.2f} "
              f"{r['selection']:>9.2f} {r['selection'] / r['sdpa']:>5.2f}x {r['selection'] / r['eager']:>5.2f}x {full}")
    print("target: selection <= 1.5x SDPA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
