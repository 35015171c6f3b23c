#!/usr/bin/env python
"""Benchmark of the long-context task grid (:mod:`attngeom.kvcache.tasks`) against one full-cache
``model.generate`` of the same example, on the bundled model (float32, CPU unless ``--device``).

For ``--examples`` RULER examples of ``--task`` at ``--length`` tokens, per example and side by side:

``generate``
    transformers' ``model.generate`` (SDPA, full ``DynamicCache``) of context + question, greedy,
    the task's answer length (what a user runs anyway).
``prefill``
    the plain prefill of the context (SDPA), and ``prefill-scores``: the captured prefill that
    records every policy's scores at once (:func:`attngeom.kvcache.prefill.prefill`; KVzip's
    reconstruction pass included when ``kvzip`` is among the policies).
``grid``
    the whole experiment of one example: the captured prefill, the full cache's answer, then every
    policy at every ratio (selection, gathered caches, batched question and answers).

Printed: seconds per example of each and the ratios to ``generate`` (the first target: a grid of
12 policies x 4 ratios, ``--policies 12``, within 3x ``generate``; the default is the command's grid). Medians over the examples; one process, the methods
alternating per example. On a GPU a short example (``WARM_UP_LENGTH`` tokens) is run once unmeasured
first (kernel warm-up) and every time ends with a synchronisation.

Usage::

    python benchmarks/bench_kvtasks.py                                  # niah_single, 4096 tokens, 2 examples
    python benchmarks/bench_kvtasks.py --length 2048 --mode query-aware  # the query-aware mode
    python benchmarks/bench_kvtasks.py --policies 12                     # the first target's 12 policies
    python benchmarks/bench_kvtasks.py --length 1024 --examples 1        # smoke run
    python benchmarks/bench_kvtasks.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

FIRST_GRID = ("random", "streamingllm", "knorm", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "vatp",
              "criticalkv", "dropkv", "snap_contribution")


WARM_UP_LENGTH = 512


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--examples", type=int, default=2)
    ap.add_argument("--policies", default=None,
                    help="comma-separated, or 12: the first target's 12 policies (default: the command's grid)")
    ap.add_argument("--mode", default="question-agnostic", choices=("question-agnostic", "query-aware"))
    ap.add_argument("--ratios", default="0.25,0.5,0.75,0.875")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: load_model's, float32 on CPU)")
    a = ap.parse_args(argv)

    import torch

    from attngeom import load_model
    from attngeom.kvcache import prefill as P
    from attngeom.kvcache import ruler, tasks
    from attngeom.kvcache.policies import get_policy
    from attngeom.kvcache.settings import KVTaskSettings

    if a.threads:
        torch.set_num_threads(a.threads)
    h = load_model(a.model, device=a.device, dtype=a.dtype)
    cuda = h.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(h.device)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    if a.policies is None:
        policies = KVTaskSettings().policies
    elif a.policies == "12":
        policies = FIRST_GRID
    else:
        policies = tuple(p.strip() for p in a.policies.split(",") if p.strip())
    settings = KVTaskSettings(policies=policies, ratios=tuple(float(r) for r in a.ratios.split(",")), mode=a.mode)
    examples = ruler.make_examples(h.tokenizer, a.task, a.length, a.examples, seed=0)
    times: dict[str, list[float]] = {k: [] for k in ("generate", "prefill", "prefill-scores", "grid")}

    def run(ex, record: bool) -> None:
        c, q, _ = ruler.encode_example(ex, h.tokenizer)
        ids = torch.tensor([c + q], device=h.device)
        read = c + q if a.mode == "query-aware" else c           # what the grid's prefill reads
        with torch.no_grad():
            t = {"generate": timed(lambda: h.model.generate(ids, attention_mask=torch.ones_like(ids),
                                                             max_new_tokens=ex.max_new_tokens, do_sample=False)),
                 "prefill": timed(lambda: P.prefill(h, read, [get_policy("window")])),
                 "prefill-scores": timed(lambda: P.prefill(h, read, [get_policy(p) for p in policies])),
                 "grid": timed(lambda: tasks.answer_example(h, ex, settings))}
        if record:
            for k, v in t.items():
                times[k].append(v)

    if cuda:   # warm-up: the kernels' first launches, on a short example (not a second full one)
        run(ruler.make_examples(h.tokenizer, a.task, min(a.length, WARM_UP_LENGTH), 1, seed=1)[0], record=False)
    for ex in examples:
        run(ex, record=True)
    gen = statistics.median(times["generate"])
    print(f"{h.name}, {a.task} at {a.length} tokens, {len(examples)} examples, {len(policies)} policies x "
          f"{len(settings.ratios)} ratios, {a.mode}, {h.device}, {h.model.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'method':<16}{'seconds':>10}{'x generate':>12}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:<16}{m:>10.2f}{m / gen:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
