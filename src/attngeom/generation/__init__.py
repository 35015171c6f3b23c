"""The model's own answer, analysed step by step with its KV cache (SPEC §7): the prompt and its chat
template (:mod:`.prompts`), the decoding loop and its caches (:mod:`.decoding`), the answer tables
(:mod:`.answers`), the heads behind a token (:mod:`.heads`) and what they do to it (:mod:`.effects`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "prompt_ids": "prompts",
    "model_stop_ids": "decoding",
    "Decoding": "decoding",
    "generate": "decoding",
    "stream_generation": "decoding",
    "stream_generation_ids": "decoding",
    "BatchMappedLayer": "decoding",
    "GrowingLayer": "decoding",
    "GrowingCache": "decoding",
    "AnswerSources": "answers",
    "Answers": "answers",
    "generation_stage": "decoding",
    "FALLBACK_CHAT_TEMPLATE": "prompts",
    "chat_template_of": "prompts",
    "template_positions": "prompts",
    "AnswerHeads": "heads",
    "head_table": "heads",
    "direct_effects": "effects",
})
