"""The single-text analysis of ``attngeom analyze`` as an experiment (:mod:`.single_text`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "AnalyzeSettings": "settings",
    "TOP_K": "single_text",
    "MIN_SEEN_BY": "single_text",
    "cut_windows": "single_text",
    "add_input_positions": "single_text",
    "per_layer_sinks": "single_text",
    "top_tokens": "single_text",
    "summarize": "single_text",
    "DEFINITIONS": "single_text",
    "experiment": "single_text",
    "map_window": "single_text",
    "analysed_layers": "single_text",
    "figure_layers": "single_text",
    "check_heads": "single_text",
    "input_windows": "single_text",
    "window_sums": "single_text",
    "build_summary": "single_text",
    "with_token_strings": "single_text",
    "generate_answer": "single_text",
    "generation_summary": "single_text",
    "answer_experiment": "single_text",
})
