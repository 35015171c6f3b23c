"""A KV-cache policy of one's own, in one's own module outside attngeom: it runs in
``attngeom kvtasks --policies module:Class`` (a subprocess, the module found on PYTHONPATH) and in
:func:`attngeom.kvcache.generate.compressed_generate`, with no edit of attngeom (docs/kvcache.md,
"A policy of your own")."""

import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

from attngeom.errors import InputError

MODULE = textwrap.dedent('''
    from attngeom.kvcache.policies import Policy


    class FirstAndLoud(Policy):
        """The first 2 entries, then those the last 8 queries attend to most."""

        name, needs, last, accumulate = "first_and_loud", "attention", 8, False

        def priority(self, ctx):
            return ctx.sinks(2).long(), ctx.score
''')


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_policies", None)


def test_own_policy_compresses_as_its_priority_says(own_module):
    from attngeom.kvcache import prefill as P
    from attngeom.kvcache.policies import get_policy
    from attngeom.kvcache.generate import compressed_generate
    from tiny_models import eager_attentions, tiny_model

    h = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ctx, q = torch.randint(4, 128, (40,), generator=g).tolist(), [5, 6, 7]
    policy = get_policy("my_policies:FirstAndLoud")
    assert policy.name == "first_and_loud" and get_policy("first_and_loud") is policy    # registered by its name
    pre = P.prefill(h, ctx, [policy])
    sel = P.selection_at_ratio(pre, policy, 0.5, h.num_heads)
    att = eager_attentions(h, ctx)
    r = h.num_heads // h.num_kv_heads
    for l, idx in sel.idx.items():
        score = att[l][0, :, -8:].float().sum(1).reshape(h.num_kv_heads, r, -1).mean(1)   # [Hkv, n]
        score[:, :2] = float("inf")                                                        # the first 2 entries
        want = score.topk(20, dim=-1).indices.sort(-1).values
        assert torch.equal(idx[0], want), l
    out = compressed_generate(h, ctx, q, "my_policies:FirstAndLoud", 0.5, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= len(ctx) + len(q) + 4 and out[0, :43].tolist() == ctx + q


def test_own_policy_runs_in_kvtasks_from_the_command_line(own_module, tiny_llama_dir, tmp_path):
    from attngeom.kvcache.ruler import Example, write_jsonl

    ex = [Example("toy", i, 0, "the key is abc. " * 3, "\nWhat is the key?", " The key is", ("abc",), 4, 76)
          for i in range(2)]
    examples = write_jsonl(ex, tmp_path / "examples.jsonl")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(own_module), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "attngeom", "kvtasks", "--model", str(tiny_llama_dir),
                           "--examples-file", str(examples), "--policies", "my_policies:FirstAndLoud,snapkv",
                           "--ratios", "0.5", "--out", str(out), "--no-progress", "--no-figures"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    answers = pd.read_parquet(out / "answers.parquet")
    assert set(answers["policy"]) == {"full", "first_and_loud", "snapkv"} and len(answers) == 2 * 3
    assert (answers.loc[answers["policy"] == "first_and_loud", "kept_share"] == 0.5).all()

    # the project's tools read the run in processes that never load my_policies: they know the
    # policy's kind from the run's record (pairs.parquet), and write the tables and the figure
    tools = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    tables = subprocess.run([sys.executable, os.path.join(tools, "kvtasks_tables.py"), str(out)], env=bare,
                            capture_output=True, text=True, timeout=600)
    assert tables.returncode == 0 and "| first_and_loud |" in tables.stdout, tables.stderr
    drawn = subprocess.run([sys.executable, "-m", "attngeom.reports.kvtasks", str(out)], env=bare,
                           capture_output=True, text=True, timeout=600)
    assert drawn.returncode == 0 and (out / "kvtasks-accuracy.png").is_file(), drawn.stderr


@pytest.mark.parametrize("spec, message", [
    ("my_policies:Nope", "has no Nope"),
    ("no_such_module_here:X", "cannot import no_such_module_here"),
    ("my_policies:", "module:Class"),
    ("os:getcwd", "is not a KV-cache policy"),
])
def test_a_bad_policy_spec_is_one_line(own_module, spec, message):
    from attngeom.kvcache.policies import get_policy

    with pytest.raises(InputError, match=message):
        get_policy(spec)
