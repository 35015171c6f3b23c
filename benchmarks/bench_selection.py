"""Benchmark: selection geometry (SPEC §5) for all layers and heads vs one eager forward pass.

One window of ``--tokens`` (default 1024) tokens of the shared WikiText file (random token ids when
the file is missing). Timed side by side in one run, alternating, ``--repeats`` times (medians):

- ``eager``: one forward pass of the model with ``attn_implementation="eager"``;
- ``selection``: :func:`attngeom.trace.stream` with :class:`attngeom.selection.SelectionStats` on
  every layer: the captured forward plus, at the last query, every N (1, 2, 4, …, 256 below the
  window), both distances, top-N with and without the sink, 8 random repeats, the sink-aware regime
  parameters (the target's workload); then the command's full default beside it: also 8 random
  repeats drawn without the sink and the sink-aware prediction;
- ``capture``: the same captured forward with no observer (to split the selection's own cost).

Target: ``selection / eager <= 2``. Run: ``.venv/bin/python benchmarks/bench_selection.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attngeom.capture import Session  # noqa: E402
from attngeom.model import load_model  # noqa: E402
from attngeom.reducers import Batch  # noqa: E402
from attngeom.selection import SelectionStats  # noqa: E402
from attngeom.trace import forward, stream  # noqa: E402

DATA = Path("/work/shared/data/wikitext-2-raw-test.txt")


def window_ids(handle, tokens: int) -> list[int]:
    if DATA.exists():
        from attngeom.data import load_windows

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
        model(input_ids=x, use_cache=False)
        return time.perf_counter() - t
    finally:
        model.set_attn_implementation(previous)


def time_capture(handle, ids) -> float:
    batch = Batch(ids=torch.tensor([ids]), lengths=torch.tensor([len(ids)]), index=[0])
    t = time.perf_counter()
    forward(handle, batch, Session(observers=[]))
    return time.perf_counter() - t


def time_selection(handle, ids, repeats: int, predict: bool, random_without_sink: bool) -> tuple[float, SelectionStats]:
    red = SelectionStats(repeats=repeats, predict=predict, random_without_sink=random_without_sink)
    t = time.perf_counter()
    stream(handle, [ids], [red], progress=False)
    return time.perf_counter() - t, red


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds (medians reported)")
    ap.add_argument("--random-repeats", type=int, default=8)
    ap.add_argument("--no-predict", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    handle = load_model(args.model)
    ids = window_ids(handle, args.tokens)
    print(f"model {handle.name}: {handle.num_layers} layers x {handle.num_heads} heads; window {len(ids)} tokens; "
          f"torch threads {torch.get_num_threads()}")
    time_eager(handle, ids[:64])  # warm-up
    eager, sdpa, capture, core, full = [], [], [], [], []
    red = None
    for r in range(args.repeats):
        eager.append(time_eager(handle, ids))
        sdpa.append(time_eager(handle, ids, "sdpa"))
        capture.append(time_capture(handle, ids))
        t, red = time_selection(handle, ids, args.random_repeats, predict=False, random_without_sink=False)
        core.append(t)
        if not args.no_predict:
            t, _ = time_selection(handle, ids, args.random_repeats, predict=True, random_without_sink=True)
            full.append(t)
        print(f"round {r}: eager {eager[-1]:.2f}s  captured forward {capture[-1]:.2f}s  selection {core[-1]:.2f}s"
              + (f"  full default {full[-1]:.2f}s" if full else ""), flush=True)
    e, c, s = statistics.median(eager), statistics.median(capture), statistics.median(core)
    sel, _ = red.result()
    print(f"selection rows {len(sel)}; layers {sel['layer'].nunique()}; heads {sel['head'].nunique()}; "
          f"N {sorted(sel['N'].unique().tolist())}; distances {sorted(sel['distance'].unique())}; "
          f"kinds {sorted(sel['kind'].unique())}; random repeats {args.random_repeats}; "
          f"bound violations {red.violations} of {red.selections}")
    print(f"median eager forward        {e:8.2f} s")
    print(f"median captured forward     {c:8.2f} s")
    print(f"median selection (total)    {s:8.2f} s   of which geometry ~{max(0.0, s - c):.2f} s")
    print(f"median SDPA forward         {statistics.median(sdpa):8.2f} s")
    rs = s / statistics.median(sdpa)
    print(f"ratio selection / SDPA forward = {rs:.2f}x  (target <= 1.5x: {'met' if rs <= 1.5 else 'NOT met'})")
    ratio = s / e
    print(f"ratio selection / eager forward = {ratio:.2f}x  (target <= 2x: {'met' if ratio <= 2 else 'NOT met'})")
    if full:
        f = statistics.median(full)
        print(f"median full default (+ random without sink, + prediction) {f:8.2f} s; ratio {f / e:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
