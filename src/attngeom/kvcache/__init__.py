"""KV-cache eviction under a budget (SPEC §9): a compressed KV cache (:mod:`.cache`), its eviction policies (:mod:`.policies`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "CompressedLayer": "cache",
    "CompressedCache": "cache",
    "CacheScorer": "cache",
    "compressing": "cache",
    "read": "cache",
    "configurations": "cache",
    "experiment": "cache",
    "answer": "cache",
    "answers": "cache",
    "summarize": "cache",
    "summarize_answers": "cache",
    "pairwise": "cache",
    "Policy": "policies",
    "POLICIES": "policies",
    "get_policy": "policies",
    "KVCacheSettings": "settings",
})
