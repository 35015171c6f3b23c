"""The model's own answer, analysed step by step with its KV cache (SPEC §7): :mod:`.decoding`; the heads
behind a token (:mod:`.heads`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "prompt_ids": "decoding",
    "model_stop_ids": "decoding",
    "Decoding": "decoding",
    "generate": "decoding",
    "stream_generation": "decoding",
    "stream_generation_ids": "decoding",
    "BatchMappedLayer": "decoding",
    "GrowingLayer": "decoding",
    "GrowingCache": "decoding",
    "AnswerSources": "decoding",
    "Answers": "decoding",
    "generation_stage": "decoding",
    "FALLBACK_CHAT_TEMPLATE": "decoding",
    "chat_template_of": "decoding",
    "template_positions": "decoding",
    "AnswerHeads": "heads",
    "head_table": "heads",
})
