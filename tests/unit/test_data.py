"""Corpora: windows, JSONL fields, WikiText files, and their errors."""

import json
from pathlib import Path

import pytest

from attngeom.data.corpora import check_layers, load_windows, parse_float_list, parse_int_list, read_texts, resolve_texts, windows
from attngeom.errors import InputError
from tiny_models import BOS_ID

WIKI = Path(__file__).resolve().parents[1] / "data" / "wikitext-2-raw-test-excerpt.txt"


def test_windows_cut_with_bos_and_stride():
    ids = list(range(10, 30))                       # 20 tokens
    w = windows(ids, window=6, bos=1)               # 5 body tokens each
    assert w == [[1, 10, 11, 12, 13, 14], [1, 15, 16, 17, 18, 19], [1, 20, 21, 22, 23, 24],
                 [1, 25, 26, 27, 28, 29]]
    w = windows(ids, window=6, stride=3, bos=1, max_windows=2)
    assert w == [[1, 10, 11, 12, 13, 14], [1, 13, 14, 15, 16, 17]]
    # a trailing partial window is dropped, a short text gives one short window
    assert windows(list(range(7)), window=6, bos=None) == [[0, 1, 2, 3, 4, 5]]
    assert windows([5, 6, 7], window=6, bos=1) == [[1, 5, 6, 7]]


def test_window_options_validated():
    with pytest.raises(InputError, match="at least 2"):
        windows([1, 2, 3], window=1)
    with pytest.raises(InputError, match="stride"):
        windows([1, 2, 3], window=3, stride=-1)


def test_jsonl_fields_joined(tmp_path):
    f = tmp_path / "gsm.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}", "x": 1}) for i in range(3)))
    assert read_texts(f, ["question", "answer"]) == ["q0\na0", "q1\na1", "q2\na2"]
    with pytest.raises(InputError, match="'solution' is missing"):
        read_texts(f, ["question", "solution"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(InputError, match=":2: not valid JSON"):
        read_texts(bad)


def test_missing_empty_and_binary_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_texts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(InputError, match="no text"):
        read_texts(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(InputError, match="UTF-8"):
        read_texts(tmp_path / "bin.txt")
    with pytest.raises(InputError, match="directory"):
        read_texts(tmp_path)


def test_hf_dataset_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(InputError):
        resolve_texts("hf:wikitext:wikitext-2-raw-v1@test")


def test_load_windows_from_wikitext(tiny_llama):
    w = load_windows(tiny_llama, str(WIKI), window=64, max_windows=5)
    assert len(w) == 5 and all(len(x) == 64 and x[0] == BOS_ID for x in w)
    # consecutive windows continue the text (no overlap by default)
    text_ids = tiny_llama.tokenizer(WIKI.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert w[0][1:] + w[1][1:] == text_ids[:126]


def test_load_windows_refuses_window_longer_than_context(tiny_llama):
    with pytest.raises(InputError, match="context"):
        load_windows(tiny_llama, str(WIKI), window=tiny_llama.max_positions + 1)


def test_parsers():
    assert parse_int_list("0, 3,5", "--layers") == [0, 3, 5]
    assert parse_int_list("all", "--layers") is None
    with pytest.raises(InputError, match="--layers"):
        parse_int_list("0,x", "--layers")
    assert parse_float_list("0.1,0.5", "--ratios") == [0.1, 0.5]
    with pytest.raises(InputError, match="does not exist"):
        check_layers([0, 9], 3)


def test_jsonl_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"latin1\.jsonl:2: not UTF-8") as e:
        read_texts(f)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line, kind", [("5", "a number"), ("[1, 2]", "an array"), ('"text"', "a string"),
                                        ("null", "null"), ("true", "a boolean"), ("1.5e3", "a number")])
def test_jsonl_line_that_is_not_an_object(tmp_path, line, kind):
    f = tmp_path / "odd.jsonl"
    f.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(InputError, match=rf"odd\.jsonl:3: expected a JSON object, got {kind}$"):
        read_texts(f)


def test_fields_refused_for_plain_text(tmp_path):
    f = tmp_path / "plain.txt"
    f.write_text("some text")
    assert read_texts(f) == ["some text"]
    with pytest.raises(InputError, match=r"fields \(question\) apply to \.jsonl, \.csv and \.parquet files .*plain\.txt is read as plain text"):
        read_texts(f, ["question"])
    with pytest.raises(InputError, match="plain text"):
        resolve_texts(str(f), ["text"])


def test_json_error_message_is_complete(tmp_path):
    f = tmp_path / "ctrl.jsonl"
    f.write_text('{"text": "a\tb"}\n')               # a raw tab inside a string: "Invalid control character at"
    with pytest.raises(InputError) as e:
        read_texts(f)
    msg = str(e.value)
    assert msg.endswith("ctrl.jsonl:1: not valid JSON at column 12 (Invalid control character)"), msg
    assert not msg.rstrip(")").endswith(" at")
    f.write_text('{"text": "a"} trailing\n')
    with pytest.raises(InputError, match=r":1: not valid JSON at column 15 \(Extra data\)$"):
        read_texts(f)


def test_jsonl_empty_object_names_missing_field(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("{}\n")
    with pytest.raises(InputError, match=r"'text' is missing \(fields present: none\)"):
        read_texts(f)


# --------------------------------------------------------------------------------------------
# One rule for fields; byte-order marks; nesting depth; CSV, Parquet and save_to_disk folders
# --------------------------------------------------------------------------------------------

RECORDS = [{"question": "What is two plus two?", "answer": "four", "n": 4, "id": "a"},
           {"question": "Name a colour, please.", "answer": "blue, or \"red\"\non two lines", "n": 7, "id": "b"},
           {"question": "Half of five?", "answer": "two and a half", "n": 12, "id": "c"}]
JOINED = ["What is two plus two?\nfour\n4", "Name a colour, please.\nblue, or \"red\"\non two lines\n7",
          "Half of five?\ntwo and a half\n12"]


def _write(fmt: str, path: Path, records: list[dict]) -> Path:
    """``records`` in format ``fmt`` (jsonl, csv, parquet, saved = a save_to_disk folder)."""
    import pandas as pd

    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "csv":
        path = path.with_suffix(".csv")
        pd.DataFrame(records).to_csv(path, index=False)
    elif fmt == "parquet":
        path = path.with_suffix(".parquet")
        pd.DataFrame(records).to_parquet(path, index=False)
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("value, kind", [(["x", "y"], "a list"), ({"a": 1}, "an object"), (None, "null"),
                                         (True, "a boolean"), (False, "a boolean")])
def test_jsonl_fields_must_be_strings_or_numbers(tmp_path, value, kind):
    f = tmp_path / "typed.jsonl"
    f.write_text(json.dumps({"text": "fine", "extra": 7}) + "\n" + json.dumps({"text": "hello", "extra": value}) + "\n")
    assert read_texts(f) == ["fine", "hello"]  # only the fields asked for are checked
    with pytest.raises(InputError) as e:
        read_texts(f, ["text", "extra"])
    assert str(e.value) == f"{f}:2: field 'extra' is {kind}; a field must be a string or a number"
    f.write_text('{"text": 2.5, "n": -3}\n')
    assert read_texts(f, ["text", "n"]) == ["2.5\n-3"]  # numbers are written out as text
    f.write_text('{"text": NaN}\n')
    with pytest.raises(InputError, match=r"typed\.jsonl:1: field 'text' is null \(NaN\)"):
        read_texts(f)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "saved"])
def test_every_record_format_reads_the_same_texts(fmt, tmp_path):
    path = _write(fmt, tmp_path / "qa", RECORDS)
    assert read_texts(path, ["question", "answer", "n"]) == JOINED
    assert resolve_texts(str(path), ["question", "answer", "n"]) == JOINED  # what the commands call
    with pytest.raises(InputError, match="field 'solution' is missing .*fields present: question, answer, n, id"):
        read_texts(path, ["question", "solution"])


@pytest.mark.parametrize("fmt", ["parquet", "saved"])
@pytest.mark.parametrize("value, kind", [(["x"], "a list"), (None, "null")])
def test_typed_formats_follow_the_jsonl_field_rule(fmt, value, kind, tmp_path):
    path = _write(fmt, tmp_path / "typed", [{"text": "ok", "extra": "a" if value is None else value},
                                            {"text": "two", "extra": value}])
    with pytest.raises(InputError) as e:
        read_texts(path, ["text", "extra"])
    row = 1 if value is not None else 2
    assert str(e.value) == f"{path}: row {row}: field 'extra' is {kind}; a field must be a string or a number"


def test_csv_rows_and_errors(tmp_path):
    f = tmp_path / "c.csv"
    f.write_text("text,n\n\"a, quoted\nline\",1\n\n,2\nlast,3\n")
    assert read_texts(f) == ["a, quoted\nline", "last"]  # blank cells give no text; blank lines skipped
    assert read_texts(f, ["text", "n"]) == ["a, quoted\nline\n1", "\n2", "last\n3"]
    f.write_text("text,n\nok,1\nbad\n")
    with pytest.raises(InputError, match=r"c\.csv:3: 1 values for 2 columns"):
        read_texts(f)


def test_saved_dataset_folder_errors(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS), "test": datasets.Dataset.from_list(RECORDS)})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"several splits \(test, train\); give one split's folder"):
        read_texts(tmp_path / "dd", ["question"])
    assert read_texts(tmp_path / "dd" / "train", ["question", "answer", "n"]) == JOINED
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(InputError, match=r"save_to_disk; reading it needs `pip install attngeom\[datasets\]`"):
        read_texts(tmp_path / "dd" / "train")


def test_folder_digest_follows_its_content(tmp_path):
    from attngeom.commands.common import data_identity

    path = _write("saved", tmp_path / "ds", RECORDS)
    a = data_identity(str(path))["data_sha256"]
    assert a and a == data_identity(str(path))["data_sha256"]
    import shutil

    shutil.rmtree(path)
    _write("saved", path, RECORDS[:2])
    assert data_identity(str(path))["data_sha256"] != a


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv"])
def test_byte_order_mark_is_dropped(fmt, tmp_path, tiny_llama):
    body = {"txt": "The cat sat on the mat. " * 8,
            "jsonl": json.dumps({"text": "The cat sat on the mat. " * 8}) + "\n",
            "csv": "text\n" + "The cat sat on the mat. " * 8 + "\n"}[fmt]
    plain, marked = tmp_path / f"plain.{fmt}", tmp_path / f"bom.{fmt}"
    plain.write_bytes(body.encode("utf-8"))
    marked.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert read_texts(marked) == read_texts(plain) and not read_texts(marked)[0].startswith("\ufeff")
    assert load_windows(tiny_llama, str(marked), window=16) == load_windows(tiny_llama, str(plain), window=16)


def test_deeply_nested_jsonl_line_is_one_line(tmp_path):
    f = tmp_path / "deep.jsonl"
    deep = '{"a": ' * 100000 + "1" + "}" * 100000
    f.write_text('{"text": "ok"}\n' + '{"text": "x", "meta": ' + deep + "}\n")
    with pytest.raises(InputError) as e:
        read_texts(f)
    assert str(e.value) == f"{f}:2: JSON nested deeper than 64 levels"
    f.write_text('{"text": "[[[[ {{{{ not nesting: inside a string ' + "[" * 200 + '"}\n')
    assert read_texts(f)[0].startswith("[[[[")


# Malformed lines of ``n`` characters whose depth check a scan that restarts at each quote makes
# quadratic: an unterminated string followed by brackets, and a string of escaped quotes and
# brackets that never ends (the input that took 6.8 s at 40 KB before the check was one pass).
MALFORMED_LINES = {
    "unterminated string, then brackets": lambda n: '{"text": "' + "[{" * (n // 2),
    "escaped quotes and brackets": lambda n: '["' + '\\"[' * (n // 3),
}


def _depth_check_seconds(line: str) -> float:
    """The fastest of three depth checks of ``line``."""
    import time

    from attngeom.data.corpora import json_depth_exceeds

    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        json_depth_exceeds(line)
        best = min(best, time.perf_counter() - t)
    return best


@pytest.mark.parametrize("shape", sorted(MALFORMED_LINES))
def test_depth_check_is_linear_on_a_malformed_line(shape, tmp_path):
    # ten times the text costs about ten times the time (a quadratic check: a hundred times)
    make = MALFORMED_LINES[shape]
    ratio = _depth_check_seconds(make(1_000_000)) / _depth_check_seconds(make(100_000))
    assert ratio < 35, ratio
    f = tmp_path / "bad.jsonl"
    f.write_text(make(1_000_000) + "\n")                   # 1 MB, refused as invalid JSON
    with pytest.raises(InputError, match=r"bad\.jsonl:1: not valid JSON at column"):
        read_texts(f)


@pytest.mark.parametrize("line, deep", [
    ("[" * 65 + "]" * 65, True), ("[" * 64 + "]" * 64, False),
    ('["' + "[" * 100 + '"]', False),                     # brackets inside a string
    (r'["\\", ' + "[" * 70 + "]" * 70 + "]", True),     # an escaped backslash: the quote after it ends the string
    (r'["\"' + "[" * 70 + '"]', False),                  # an escaped quote does not end the string
    ('"' + "[" * 100, False),                             # an unterminated string: nothing after it nests
])
def test_depth_check_skips_strings_and_escapes(line, deep):
    from attngeom.data.corpora import json_depth_exceeds

    assert json_depth_exceeds(line) is deep


def test_a_csv_cell_longer_than_csvs_default_limit(tmp_path):
    import csv

    f = tmp_path / "long.csv"
    long = "word " * 40_000                                   # 200,000 characters in one cell
    f.write_text("text,n\n" + f'"{long}",1\nshort,2\n')
    limit = csv.field_size_limit()
    assert read_texts(f) == [long, "short"]
    assert csv.field_size_limit() == limit                    # the csv module's limit is left as it was


def test_a_binary_parquet_field_is_called_binary(tmp_path):
    path = _write("parquet", tmp_path / "bin", [{"text": "ok", "blob": b"\x00\x01"}])
    with pytest.raises(InputError) as e:
        read_texts(path, ["text", "blob"])
    assert str(e.value) == f"{path}: row 1: field 'blob' is binary data (bytes); a field must be a string or a number"


@pytest.mark.parametrize("kind", ["fifo", "device", "loop", "dangling"])
def test_only_regular_files_are_read(tmp_path, kind, fifo, dev_zero):
    from attngeom.commands.common import data_identity

    p = tmp_path / "corpus.txt"
    if kind == "fifo":
        p = fifo                                              # reading it would block forever
        said = "is a FIFO (named pipe), not a file"
    elif kind == "device":
        p = dev_zero                                          # reading it would never end
        said = "is a character device, not a file"
    elif kind == "loop":
        p.symlink_to(tmp_path / "other.txt")
        (tmp_path / "other.txt").symlink_to(p)
        said = "is a symlink loop"
    else:
        p.symlink_to(tmp_path / "gone.txt")
        said = "is a dangling symlink (its target"
    for read in (read_texts, data_identity):
        with pytest.raises(InputError) as e:
            read(str(p))
        assert str(e.value).startswith(f"data file {p} {said}"), e.value


def test_cli_reads_a_parquet_corpus(tiny_llama_dir, tmp_path, capsys):
    from attngeom.cli import main

    records = [{"question": "The cat sat on the mat. " * 4, "answer": i} for i in range(3)]
    data = _write("parquet", tmp_path / "qa", records)
    out = tmp_path / "o"
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--fields", "question,answer",
               "--window", "16", "--max-windows", "2", "--out", str(out), "--no-progress", "--no-figures"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["windows"] == 2
    bad = _write("parquet", tmp_path / "bad", [{"question": "q", "answer": True}])
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(bad), "--fields", "question,answer",
               "--out", str(tmp_path / "o2"), "--no-progress"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "row 1: field 'answer' is a boolean" in err[0]
    assert not (tmp_path / "o2").exists()
