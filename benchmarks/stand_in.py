#!/usr/bin/env python
"""A random-weight stand-in for a model whose weights cannot travel to a machine (an offline GPU
machine without the bundled model's package, say): its own architecture and tokenizer, random
weights. Timings and memory are the model's; answers and metric values are not.

Two steps, because the config and tokenizer are small (about 3.5 MB) and the weights are not::

    python benchmarks/stand_in.py write DIR [--model smollm2-135m]   # where the model loads: config,
                                                                     # tokenizer, generation config
    python benchmarks/stand_in.py build DIR OUT [--seed 0]           # anywhere: OUT = DIR + random
                                                                     # weights (float32 safetensors)

``OUT`` then loads like any local model folder (``load_model(OUT)``, ``--model OUT``).
``benchmarks/gpu_check.sh`` builds one from ``$GPU_CHECK_STAND_IN`` when the bundled model is not
installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def write(model: str, out: Path) -> None:
    from attngeom import load_model

    handle = load_model(model, dtype="float32", device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    handle.model.config.save_pretrained(out)
    if handle.model.generation_config is not None:
        handle.model.generation_config.save_pretrained(out)
    handle.tokenizer.save_pretrained(out)
    (out / "STAND_IN.txt").write_text(f"config and tokenizer of {model} ({handle.name}); no weights\n")
    print(f"stand_in: wrote the config and tokenizer of {handle.name} to {out}")


def build(src: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (src / "config.json").is_file():
        print(f"stand_in: {src} holds no config.json (write it with: stand_in.py write {src})", file=sys.stderr)
        raise SystemExit(2)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shutil.copytree(src, out, dirs_exist_ok=True)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"stand_in: {out}: {config.model_type}, {config.num_hidden_layers} layers, {n / 1e6:.0f}M parameters, "
          f"random weights (seed {seed})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    w = sub.add_parser("write", help="the model's config and tokenizer, no weights")
    w.add_argument("dir", type=Path)
    w.add_argument("--model", default="smollm2-135m")
    b = sub.add_parser("build", help="a loadable folder with random weights")
    b.add_argument("dir", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.step == "write":
        write(a.model, a.dir)
    else:
        build(a.dir, a.out, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
