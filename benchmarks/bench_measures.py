#!/usr/bin/env python
"""Cost of each token-importance measure of the registry (SPEC §2 and §2.1) against the forward users
run anyway, side by side in one process on the default model (float32, CPU).

Per window length ``T`` and measure, alternating within every repeat (the order rotates, so load from
other jobs hits every method alike; medians of ``--repeats``):

``sdpa`` / ``eager``
    a plain forward pass of one window (transformers' ``sdpa`` attention, its default, and ``eager``).
``score:<measure>``
    the captured forward (:class:`attngeom.capture.session.Session`) with an observer that computes
    the measure's token-level score ``[B, Q, S]`` on every block of every layer (what ``analyze``
    and the explorer pay to show it).
``rank:<measure>``
    the faithfulness experiment's forward masking the top half of the sources by the measure
    (comprehensiveness, ratio 0.5, every layer; one row): what each point of the head-to-head costs.
``prepare:<measure>``
    for the measures computed before the forward that ranks by them
    (:func:`attngeom.capture.prepared.prepare`): the pass itself, once per text and shared by every
    ranked forward of it: gradient × attention's forward and backward pass through differentiable
    eager attention, a rollout's captured forward and its composition over the layers. Their
    ``score:`` row is that pass plus the captured forward reading its maps (what ``analyze(...,
    prepare=[...])`` pays); their ``rank:`` row the ranked forward given the maps.

Prints seconds and the ratios to both plain forwards.

    python benchmarks/bench_measures.py                  # T=128,512; 1 thread; 5 repeats
    python benchmarks/bench_measures.py --sizes 128 --repeats 3 --threads 0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class Score:
    """Observer: the token-level score of one measure on every block (kept only until the next)."""

    def __init__(self, name: str):
        self.name = name
        from attngeom.metrics import registry

        self.needs = registry.closure([name])

    def observe(self, block) -> None:
        block.token_score(self.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from attngeom import load_model
    from attngeom.capture.interventions import RankIntervention, Variant
    from attngeom.capture.session import Session
    from attngeom.capture.prepared import prepare
    from attngeom.data.corpora import SAMPLE_TEXT
    from attngeom.metrics import registry
    from attngeom.streaming.reducers import InputBatch
    from attngeom.streaming.passes import forward

    h = load_model(a.model)
    model = h.model
    measures = registry.hierarchy() + registry.rivals()
    body = h.encode(SAMPLE_TEXT)
    print(f"{a.model}, float32, torch threads {torch.get_num_threads()}, median of {a.repeats} repeats")
    for T in (int(s) for s in a.sizes.split(",")):
        ids = (body * (T // len(body) + 1))[:T]
        x = torch.tensor([ids])
        batch = InputBatch(ids=x, lengths=torch.tensor([T]), index=[0])

        def plain(impl):
            def run():
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    model(input_ids=x, use_cache=False, logits_to_keep=1)
            return run

        before = registry.prepared_names(measures)
        maps = {m: prepare(h, ids, T - 1, [m]) for m in before}

        def prepass(m):
            return lambda: prepare(h, ids, T - 1, [m])

        def score(m):
            if m in before:
                return lambda: forward(h, batch, Session(observers=[Score(m)], prepared=prepare(h, ids, T - 1, [m])))
            return lambda: forward(h, batch, Session(observers=[Score(m)]))

        def rank(m):
            v = Variant(m, "comprehensiveness", 0.5)
            return lambda: forward(h, batch, Session(intervention=RankIntervention(v), prepared=maps.get(m)))

        methods = {"sdpa": plain("sdpa"), "eager": plain("eager")}
        methods |= {f"prepare:{m}": prepass(m) for m in before}
        methods |= {f"score:{m}": score(m) for m in measures}
        methods |= {f"rank:{m}": rank(m) for m in measures}
        for fn in methods.values():                      # warm-up
            fn()
        times: dict[str, list[float]] = {k: [] for k in methods}
        names = list(methods)
        for r in range(a.repeats):
            for k in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                methods[k]()
                times[k].append(time.perf_counter() - t0)
        model.set_attn_implementation("sdpa")
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nT = {T}")
        print(f"{'method':<28} {'seconds':>8} {'x SDPA':>7} {'x eager':>8}")
        for k in names:
            print(f"{k:<28} {med[k]:8.3f} {med[k] / med['sdpa']:7.2f} {med[k] / med['eager']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
