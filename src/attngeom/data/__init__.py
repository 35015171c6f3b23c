"""Corpora and windows: :mod:`.corpora`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SAMPLE_TEXT": "corpora",
    "BOM": "corpora",
    "MAX_DEPTH": "corpora",
    "SAVED_DATASET_FILES": "corpora",
    "TABLE_SUFFIXES": "corpora",
    "utf8_text": "corpora",
    "read_texts": "corpora",
    "field_text": "corpora",
    "corpus_digest": "corpora",
    "json_depth_exceeds": "corpora",
    "json_object": "corpora",
    "read_hf_dataset": "corpora",
    "resolve_texts": "corpora",
    "windows": "corpora",
    "load_windows": "corpora",
    "parse_int_list": "corpora",
    "parse_float_list": "corpora",
    "check_layers": "corpora",
    "input_path": "corpora",
    "FILE_KINDS": "corpora",
    "CSV_FIELD_LIMIT": "corpora",
})
