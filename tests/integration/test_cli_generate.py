"""``attngeom analyze`` and ``attngeom explore`` with ``--generate``: the model's own answer, end to
end on tiny models saved as local Hugging Face directories; bad input is one line and exit 2."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from attngeom import analyze, load_model
from attngeom.cli import main
from tiny_models import tiny_chat_tokenizer, tiny_model

TEXT = "The cat sat"
N = 6


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny random Llama whose tokenizer has a chat template (its EOS ``</s>`` closes each turn)."""
    d = tmp_path_factory.mktemp("tiny-chat")
    handle = tiny_model("llama")
    handle.model.save_pretrained(d)
    tiny_chat_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def run_generate(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen_out")
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--generate", str(N),
                 "--out", str(out), "--no-progress"]) == 0
    return out


def _fails(capsys, argv, *needles):
    """Exit 2 with one error line, the last on stderr (a model load may print its progress before)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert errors[0].startswith(f"attngeom {argv[0]}: error: ")
    for n in needles:
        assert n in errors[0], (n, errors[0])


def test_analyze_generate_writes_the_answer_tables(run_generate, tiny_llama_dir):
    handle = load_model(str(tiny_llama_dir))
    trace = analyze(handle, TEXT, generate=N)                  # the Python API, same greedy answer
    P, T, L = trace.prompt_length, len(trace.ids), handle.num_layers
    summary = json.loads((run_generate / "summary.json").read_text())
    gen = summary["generation"]
    assert gen["prompt_tokens"] == P and gen["answer_tokens"] == T - P
    assert gen["answer_text"] == handle.tokenizer.decode(trace.ids[P:])
    assert summary["settings"]["generate"] == N and summary["settings"]["sample"] is False
    assert abs(sum(gen["mean_contribution_share"].values()) - 1) < 1e-4
    report = (run_generate / "report.md").read_text()
    assert "## The model's answer" in report and f"{P} prompt tokens, {T - P} generated" in report
    for f in ("answer_shares.parquet", "answer_sources.parquet", "answer_summary.parquet"):
        assert f in summary["files"] and (run_generate / f).is_file()
    tokens = pd.read_parquet(run_generate / "tokens.parquet")
    first = tokens[tokens["layer"] == 0]
    assert first["token_id"].tolist() == trace.ids
    assert first["generated"].tolist() == trace.generated.tolist()
    # the summaries (seen as a text during the generation) are those of prompt + answer analysed as a text
    from attngeom import TokenStats, stream

    (ref,) = stream(handle, [trace.ids], [TokenStats()], progress=False)
    ref = ref.result()
    num = [c for c in ref.columns if c not in ("text", "layer", "position", "token_id")]
    assert np.allclose(tokens[num].to_numpy(float), ref[num].to_numpy(float), rtol=1e-4, atol=1e-5)
    shares = pd.read_parquet(run_generate / "answer_shares.parquet")
    assert len(shares) == (T - P) * (L + 1)
    assert str(shares["layer"].dtype) == "Int64" and shares["layer"].isna().sum() == T - P   # null: the model
    # the tables' contribution rows are the full trace's C_ij rows (producing row = position - 1)
    for layer in range(L):
        C = trace.layers[layer].contribution_inter.sum(0)
        sel = shares[shares["layer"] == layer].sort_values("step")
        assert np.allclose(sel["contribution_sink"], C[P - 1:T - 1, 0], atol=1e-5)
        assert np.allclose(sel["contribution_answer"], [C[q, P:q + 1].sum() for q in range(P - 1, T - 1)], atol=1e-5)
    src = pd.read_parquet(run_generate / "answer_sources.parquet")
    assert set(src["metric"]) == {"attention", "contribution"} and (src["source"] <= src["query"]).all()
    assert set(src["part"]) == {"prompt", "answer"} and not src["is_special"].any()   # the earlier answer ranks too
    assert src["source_token"].tolist() == handle.tokens(src["source_id"].tolist())
    heads = pd.read_parquet(run_generate / "answer_heads.parquet")
    for step in range(T - P):                       # each token's table: its producing row in the full trace
        want = trace.heads_for(P + step, top=10)
        got = heads[(heads["step"] == step) & (heads["by"] == "contribution")]
        assert np.allclose(got["share"], want["share"], atol=1e-5)
        assert got["source_token"].tolist() == want["source_token"].tolist()
    whole = heads[heads["step"].isna() & (heads["by"] == "attention")]
    assert np.allclose(whole["share"], trace.heads_for("answer", by="attention")["share"], atol=1e-5)
    report = (run_generate / "report.md").read_text()
    assert "Heads behind the whole answer" in report and "answer_heads.parquet" in report


def test_analyze_generate_resumes(run_generate, tiny_llama_dir, capsys):
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--generate", str(N),
                 "--out", str(run_generate), "--no-progress"]) == 0
    assert "already holds this complete run" in capsys.readouterr().err


def test_explore_generate_marks_the_answer(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["explore", "--model", str(tiny_llama_dir), "--text", TEXT, "--generate", str(N), "--sample",
                 "--seed", "7", "--out", str(out)]) == 0
    page = (out / "explore.html").read_text()
    data = json.loads(re.search(r'<script id="explore-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1))
    handle = load_model(str(tiny_llama_dir))
    trace = analyze(handle, TEXT, generate=N, sample=True, seed=7)
    assert data["T"] == len(trace.ids) and data["answer"]["prompt_length"] == trace.prompt_length
    assert data["initial_query"] == trace.prompt_length - 1
    P = trace.prompt_length
    C = np.mean([lt.contribution_inter.sum(0) for lt in trace.layers], axis=0)
    assert np.allclose(data["answer"]["model"]["contribution"], C[P - 1:-1, :P].mean(0), atol=1e-5)


def test_chat_prompts(chat_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["analyze", "--model", str(chat_dir), "--text", "hi", "--chat", "--system", "be brief",
                 "--generate", "3", "--out", str(out), "--no-progress"]) == 0
    handle = load_model(str(chat_dir))
    want = analyze(handle, "hi", chat=True, system="be brief", generate=3)
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert tokens[tokens["layer"] == 0]["token_id"].tolist() == want.ids
    # a .json prompt file holds chat messages
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    out2 = tmp_path / "o2"
    assert main(["explore", "--model", str(chat_dir), "--file", str(msgs), "--generate", "3", "--out", str(out2)]) == 0
    page = (out2 / "explore.html").read_text()
    data = json.loads(re.search(r'<script id="explore-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1))
    assert data["T"] == len(want.ids) and data["answer"]["prompt_length"] == want.prompt_length


BAD_OPTIONS = [
    (["--generate", "0"], "--generate must be at least 1"),
    (["--generate", "-2"], "--generate must be at least 1"),
    (["--generate", "3", "--temperature", "0.7"], "add --sample"),
    (["--generate", "3", "--sample", "--top-p", "0"], "top-p"),
    (["--generate", "3", "--system", "x"], "--system needs --chat"),
    (["--chat"], "add --generate"),
]


@pytest.mark.parametrize("command, extra, needle",
                         [(c, e, n) for c in ("analyze", "explore") for e, n in BAD_OPTIONS]
                         + [("analyze", ["--generate", "3", "--window", "8"], "--window does not apply")])
def test_bad_options_before_load(no_model, capsys, tmp_path, command, extra, needle):
    _fails(capsys, [command, "--text", TEXT, "--out", str(tmp_path / "o"), *extra], needle)
    assert not (tmp_path / "o" / "summary.json").exists()


def test_bad_messages_file_before_load(no_model, capsys, tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("[{\"role\": \"user\"")
    _fails(capsys, ["analyze", "--file", str(bad), "--generate", "2", "--out", str(tmp_path / "o")], "not valid JSON")
    bad.write_text(json.dumps({"role": "user", "content": "x"}))
    _fails(capsys, ["analyze", "--file", str(bad), "--generate", "2", "--out", str(tmp_path / "o")], "list of")
    bad.write_text(json.dumps([{"role": "user", "content": 3}]))
    _fails(capsys, ["explore", "--file", str(bad), "--generate", "2", "--out", str(tmp_path / "o")], "'content'")


@pytest.mark.parametrize("command", ["analyze", "explore"])
def test_bad_input_after_load(tiny_llama_dir, chat_dir, capsys, tmp_path, command):
    m = ["--model", str(tiny_llama_dir)]
    assert main([command, *m, "--text", TEXT, "--chat", "--generate", "2", "--out", str(tmp_path / "chat"),
                 "--no-progress"][: None if command == "analyze" else -1]) == 0
    assert "has no chat template; the prompt uses attngeom's plain fallback template" in capsys.readouterr().err
    if command == "analyze":
        summary = json.loads((tmp_path / "chat" / "summary.json").read_text())
        assert summary["generation"]["chat_template"] == "fallback"
        assert "plain fallback template" in (tmp_path / "chat" / "report.md").read_text()
    _fails(capsys, [command, *m, "--text", TEXT, "--generate", "250", "--out", str(tmp_path / "b")],
           "context of 256")
    _fails(capsys, [command, *m, "--text", "a </s> b", "--generate", "2", "--out", str(tmp_path / "c")],
           "stop token '</s>'")
    _fails(capsys, [command, "--model", str(chat_dir), "--text", "a </s> b", "--chat", "--generate", "2",
                    "--out", str(tmp_path / "d")], "stop token")
    for d in "bcd":
        assert not (tmp_path / d / "summary.json").exists() and not (tmp_path / d / "explore.html").exists()


@pytest.mark.parametrize("command", ["analyze", "explore"])
def test_a_messages_file_is_a_chat_only_with_generate(tiny_llama_dir, capsys, tmp_path, command):
    """Without --generate a .json file is text, analysed as written, and no chat template is said to
    apply; with --generate its messages go through the (fallback) template, and that is said."""
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "user", "content": "The cat sat on the mat."}]))
    m = ["--model", str(tiny_llama_dir), "--file", str(f), "--no-progress"]
    assert main([command, *m, "--out", str(tmp_path / "text")]) == 0
    assert "chat template" not in capsys.readouterr().err
    if command == "analyze":
        summary = json.loads((tmp_path / "text" / "summary.json").read_text())
        assert "generation" not in summary
    assert main([command, *m, "--generate", "2", "--out", str(tmp_path / "chat")]) == 0
    assert "has no chat template; the prompt uses attngeom's plain fallback template" in capsys.readouterr().err


def test_corpus_mode(tiny_llama_dir, tmp_path, capsys):
    """--data: every prompt answered and analysed (the same answers as the Python API), one table
    row set per prompt; the same command again finds the run complete."""
    data = tmp_path / "prompts.jsonl"
    prompts = ["The cat sat", "a b c", "hello"]
    data.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in enumerate(prompts)))
    out = tmp_path / "o"
    argv = ["analyze", "--model", str(tiny_llama_dir), "--data", str(data), "--fields", "prompt", "--generate", "4",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    answers = pd.read_parquet(out / "answers.parquet")
    handle = load_model(str(tiny_llama_dir))
    assert answers["prompt"].tolist() == prompts
    for k, p in enumerate(prompts):
        trace = analyze(handle, p, generate=4)
        assert answers.loc[k, "answer_ids"] == " ".join(map(str, trace.ids[trace.prompt_length:]))
        assert answers.loc[k, "answer_text"] == handle.tokenizer.decode(trace.ids[trace.prompt_length:])
    shares = pd.read_parquet(out / "answer_shares.parquet")
    assert sorted(set(shares["text"])) == [0, 1, 2]
    assert len(shares) == int(answers["answer_tokens"].sum()) * (handle.num_layers + 1)
    src = pd.read_parquet(out / "answer_sources.parquet")
    assert {"text", "step", "token", "metric", "rank", "source", "source_token", "score"} <= set(src.columns)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == 3 and "answers.parquet" in summary["files"]
    # resumable: a second run with the same settings is complete
    assert main(argv) == 0
    assert "already holds this complete run" in capsys.readouterr().err


def test_corpus_mode_refusals(no_model, capsys, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    o = str(tmp_path / "o")
    _fails(capsys, ["analyze", "--data", str(data), "--fields", "prompt", "--out", o], "--data needs --generate")
    _fails(capsys, ["analyze", "--data", str(data), "--text", "x", "--generate", "2", "--out", o], "replaces --text")
    _fails(capsys, ["analyze", "--fields", "prompt", "--generate", "2", "--out", o], "go with --data")


def test_corpus_mode_two_processes_equal_one(tiny_llama_dir, tmp_path):
    """Corpus mode under torchrun (2 CPU processes): each rank answers its share of the prompts and
    the tables equal one process's, bit for bit."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from attngeom.runs.run import MANIFEST, verify

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("The cat sat", "a b c", "hello", "xyz")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNGEOM_DIST_TIMEOUT": "120"}

    def argv(out):
        return ["analyze", "--model", str(tiny_llama_dir), "--data", str(data), "--fields", "prompt",
                "--generate", "3", "--out", str(out), "--no-progress"]

    one, two = tmp_path / "one", tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "attngeom", *argv(one)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "attngeom", *argv(two)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((two / MANIFEST).read_text())["world_size"] == 2 and not verify(two)
    assert len(list((two / "checkpoint").glob("records-r1-*.jsonl"))) == 1      # rank 1 answered its own prompts
    for f in ("answers.parquet", "answer_shares.parquet", "answer_sources.parquet", "answer_summary.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(one / f), pd.read_parquet(two / f))


def test_corpus_mode_resumes_after_an_interruption(tiny_llama_dir, tmp_path, monkeypatch):
    """Interrupted at the second prompt, the same command answers only the prompts without a record
    and writes the tables a run without interruption writes."""
    import attngeom.generation.decoding as G

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("The cat sat", "a b c", "hello")))
    def argv(out):
        return ["analyze", "--model", str(tiny_llama_dir), "--data", str(data), "--fields", "prompt",
                "--generate", "3", "--out", str(out), "--no-progress"]

    real, seen = G.stream_generation_ids, []

    def interrupted(handle, ids, *a, index=0, **k):
        if index == 1:
            raise KeyboardInterrupt
        return real(handle, ids, *a, index=index, **k)

    monkeypatch.setattr(G, "stream_generation_ids", interrupted)
    assert main(argv(tmp_path / "o")) == 130
    assert not (tmp_path / "o" / "answers.parquet").exists()

    def counted(handle, ids, *a, index=0, **k):
        seen.append(index)
        return real(handle, ids, *a, index=index, **k)

    monkeypatch.setattr(G, "stream_generation_ids", counted)
    assert main(argv(tmp_path / "o")) == 0
    assert seen == [1, 2]                                   # prompt 0 came from its record
    assert main(argv(tmp_path / "fresh")) == 0
    for f in ("answers.parquet", "answer_shares.parquet", "answer_sources.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "o" / f), pd.read_parquet(tmp_path / "fresh" / f))
