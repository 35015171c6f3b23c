"""Forward passes under the capture plug-in and the observers that reduce them: inputs and passes (:mod:`.passes`), streaming reducers (:mod:`.reducers`), reducers as run stages (:mod:`.stages`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "make_batches": "passes",
    "forward": "passes",
    "stream": "passes",
    "InputBatch": "reducers",
    "Reducer": "reducers",
    "HeadStats": "reducers",
    "TokenStats": "reducers",
    "FullCapture": "reducers",
    "RouteRecord": "reducers",
    "summaries": "stages",
})
