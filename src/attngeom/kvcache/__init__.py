"""A compressed KV cache (:mod:`.cache`), its eviction policies (:mod:`.policies`), the evaluation under a budget
(:mod:`.evaluation`), compression once after the prefill to a ratio (:mod:`.prefill`), a compressed ``generate`` (:mod:`.generate`), RULER's synthetic
long-context tasks (:mod:`.ruler`), the tasks at compression ratios (:mod:`.tasks`) and the commands' experiments
(:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "CompressedLayer": "cache",
    "CompressedCache": "cache",
    "CacheScorer": "cache",
    "compressing": "cache",
    "read_under_budget": "evaluation",
    "configurations": "evaluation",
    "answer_under_budget": "evaluation",
    "answers": "evaluation",
    "summarize": "evaluation",
    "summarize_answers": "evaluation",
    "pairwise": "evaluation",
    "Policy": "policies",
    "POLICIES": "policies",
    "get_policy": "policies",
    "KVCacheSettings": "settings",
    "KVCacheInputs": "settings",
    "TASKS": "ruler",
    "Example": "ruler",
    "make_examples": "ruler",
    "encode_example": "ruler",
    "string_match_all": "ruler",
    "write_jsonl": "ruler",
    "read_jsonl": "ruler",
    "selection_at_ratio": "prefill",
    "variant_cache": "prefill",
    "greedy_answers": "prefill",
    "compressed_generate": "generate",
    "KVTaskSettings": "settings",
    "KVTaskInputs": "settings",
})
