"""KV-cache eviction under a budget (SPEC §9): a compressed KV cache (:mod:`.cache`), its eviction policies (:mod:`.policies`) and the evaluation under a budget (:mod:`.evaluation`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "KV_ATTN": "cache",
    "pool_heads": "cache",
    "kept_entries": "cache",
    "CompressedLayer": "cache",
    "CompressedCache": "cache",
    "CacheScorer": "cache",
    "compressing": "cache",
    "new_cache": "cache",
    "cached_forward": "cache",
    "read_under_budget": "evaluation",
    "taxonomy_budgets": "policies",
    "configurations": "evaluation",
    "experiment": "evaluation",
    "answer_under_budget": "evaluation",
    "answers": "evaluation",
    "summarize": "evaluation",
    "summarize_answers": "evaluation",
    "pairwise": "evaluation",
    "SINKS": "policies",
    "RECENT": "policies",
    "SNAP_WINDOW": "policies",
    "SNAP_KERNEL": "policies",
    "EvictionContext": "policies",
    "Policy": "policies",
    "POLICIES": "policies",
    "get_policy": "policies",
    "KVCacheSettings": "settings",
    "KVCacheInputs": "settings",
})
