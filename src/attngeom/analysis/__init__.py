"""The single-text analysis of ``attngeom analyze`` as an experiment (:mod:`.single_text`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "AnalyzeSettings": "settings",
    "summarize": "single_text",
    "experiment": "single_text",
    "answer_experiment": "single_text",
})
