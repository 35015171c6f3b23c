"""Corpora: windows, JSONL fields, WikiText files, and their errors."""

import json
from pathlib import Path

import pytest

from attngeom.data import (check_layers, load_windows, parse_float_list, parse_int_list, read_texts,
                           resolve_texts, windows)
from attngeom.errors import InputError
from tiny_models import BOS_ID, tiny_model

WIKI = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2-raw-test.txt"


@pytest.fixture(scope="module")
def handle():
    return tiny_model("llama")


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


def test_load_windows_from_wikitext(handle):
    w = load_windows(handle, str(WIKI), window=64, max_windows=5)
    assert len(w) == 5 and all(len(x) == 64 and x[0] == BOS_ID for x in w)
    # consecutive windows continue the text (no overlap by default)
    text_ids = handle.tokenizer(WIKI.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert w[0][1:] + w[1][1:] == text_ids[:126]


def test_load_windows_refuses_window_longer_than_context(handle):
    with pytest.raises(InputError, match="context"):
        load_windows(handle, str(WIKI), window=handle.max_positions + 1)


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
    with pytest.raises(InputError, match=r"fields \(question\) apply to \.jsonl files .*plain\.txt is read as plain text"):
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
