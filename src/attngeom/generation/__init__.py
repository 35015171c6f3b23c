"""The model's own answer, analysed step by step with its KV cache (SPEC §7): :mod:`.decoding`; the heads
behind a token (:mod:`.heads`)."""

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
    "GrowingNorms": "decoding",
    "GenerationBatch": "decoding",
    "stream_generation": "decoding",
    "stream_generation_ids": "decoding",
    "AnswerSources": "decoding",
    "Answers": "decoding",
    "generation_stage": "decoding",
    "generation_record": "settings",
    "FALLBACK_CHAT_TEMPLATE": "decoding",
    "chat_template_of": "decoding",
    "chat_text": "decoding",
    "template_positions": "decoding",
    "BY": "heads",
    "DEFAULT_TOP": "heads",
    "row_shares": "heads",
    "token_marks": "heads",
    "head_table": "heads",
    "mean_shares": "heads",
    "of_text": "heads",
    "with_marks": "heads",
    "AnswerHeads": "heads",
})
