"""What identifies a generation in a run's settings. Nothing heavy imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from attngeom.generation.decoding import Decoding

def generation_record(decoding: Decoding | None, chat: bool = False, system: str | None = None) -> dict:
    """What identifies a generation in a run's settings (empty without one)."""
    if decoding is None:
        return {}
    return {"generate": decoding.max_new_tokens, "sample": decoding.sample, "temperature": decoding.temperature,
            "top_p": decoding.top_p, "seed": decoding.seed, "chat": bool(chat), "system": system}
