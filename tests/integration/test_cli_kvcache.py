"""attngeom kvcache end to end: tables, resume, answers and bad input."""

import json

import numpy as np
import pandas as pd

from attngeom.cli import main


def test_cli_runs_resumes_and_refuses_bad_input(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("The cat sat on the mat. The dog slept by the door, and the bird sang.\n" * 8)
    out = tmp_path / "out"
    args = ["kvcache", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "40", "--max-windows", "2",
            "--policies", "full,streamingllm,contribution,taxonomy", "--budgets", "8,16", "--chunk", "2",
            "--calibration-windows", "1", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    reads = pd.read_parquet(out / "reads.parquet")
    assert len(reads) == 4 * 2 * 2 and "ppl" in reads                # (policy, budget, window)
    assert np.allclose(reads.ppl, np.exp(reads.nll / reads.tokens))
    summ = pd.read_parquet(out / "summary.parquet")
    # 2 windows are too few for an interval: none is given, in the tables or the report
    assert summ[["ppl_low", "ppl_high", "delta_low", "delta_high"]].isna().all().all() and summ.ppl.notna().all()
    assert "too few windows" in (out / "report.md").read_text()
    pairs = pd.read_parquet(out / "pairs.parquet")
    assert len(pairs) == 2 * 4 * 3                                     # budgets x ordered pairs of 4 policies
    assert (pairs.a_better.between(0, 1)).all()
    full = summ[summ.policy == "full"]
    assert (full.delta_ppl == 0).all()
    assert (summ[summ.policy == "streamingllm"].memory_saved > 0.5).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["windows"] == 2 and "kvcache-ppl.png" in summary["figures"]
    assert (out / "kvcache-ppl.png").stat().st_size > 0 and (out / "regimes.parquet").is_file()
    capsys.readouterr()
    assert main(args) == 0
    assert "already holds this complete run" in capsys.readouterr().err
    # a run stopped part-way resumes from its records
    out2 = tmp_path / "out2"
    import attngeom.kvcache.evaluation as K

    calls, real = [], K.read_under_budget

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    K.read_under_budget = flaky
    try:
        assert main(args[:-3] + ["--out", str(out2), "--no-progress"]) == 130
    finally:
        K.read_under_budget = real
    assert main(args[:-3] + ["--out", str(out2), "--no-progress"]) == 0
    again = pd.read_parquet(out2 / "reads.parquet")
    assert np.allclose(again.sort_values(["policy", "budget", "window"]).nll.to_numpy(),
                       reads.sort_values(["policy", "budget", "window"]).nll.to_numpy(), atol=1e-6)
    for bad, msg in ((["--chunk", "8"], "chunk"), (["--policies", "h2o,nope"], "unknown KV-cache policy")):
        assert main(args[:-3] + bad + ["--out", str(tmp_path / "bad")]) == 2
        assert msg in capsys.readouterr().err


def test_cli_answers(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("The cat sat on the mat. The dog slept by the door, and the bird sang.\n" * 4)
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps({"prompt": f"The cat sat on the mat {i} times and", "reference": " the dog slept"})
                            for i in range(3)))
    out = tmp_path / "out"
    args = ["kvcache", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "24", "--max-windows", "1",
            "--policies", "streamingllm", "--budgets", "8", "--answers", str(qa), "--max-examples", "2",
            "--new-tokens", "3", "--no-progress"]
    assert main(args + ["--out", str(out)]) == 0
    ans = pd.read_parquet(out / "answers.parquet")
    assert len(ans) == 2 * 2 and set(ans.policy) == {"full", "streamingllm"}
    assert (ans[ans.policy == "full"].match == 1).all()
    assert (out / "answers-summary.parquet").is_file() and (out / "kvcache-answers.png").is_file()
    assert len(json.loads((out / "summary.json").read_text())["answers"]) == 2
    qa.write_text(json.dumps({"prompt": "a prompt", "answer": "x"}) + "\n")
    assert main(args + ["--out", str(tmp_path / "bad")]) == 2
    assert "reference" in capsys.readouterr().err
