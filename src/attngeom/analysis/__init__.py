"""The single-text analysis of ``attngeom analyze`` as an experiment (:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "AnalyzeSettings": "settings",
    "summarize": "experiment",
    "answer_experiment": "experiment",
})
