"""The model's own answer, analysed step by step with its KV cache (SPEC §7): :mod:`.decoding`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "DEFAULT_TOP_K": "decoding",
    "TABLE_METRICS": "decoding",
    "chat_messages": "decoding",
    "prompt_ids": "decoding",
    "model_stop_ids": "decoding",
    "Decoding": "decoding",
    "check_context": "decoding",
    "generate": "decoding",
    "BatchMappedLayer": "decoding",
    "GrowingLayer": "decoding",
    "GrowingCache": "decoding",
    "GrowingNorms": "decoding",
    "GenerationBatch": "decoding",
    "stream": "decoding",
    "stream_ids": "decoding",
    "AnswerSources": "decoding",
    "Answers": "decoding",
    "generation_stage": "decoding",
    "generation_record": "settings",
})
