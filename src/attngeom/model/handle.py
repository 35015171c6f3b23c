"""The model handle: a loaded causal LM, its tokenizer, its architecture adapter, and readable tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from attngeom.errors import InputError
from attngeom.model.arguments import takes_handle
from attngeom.model.adapter import ArchitectureAdapter, adapter_for

if TYPE_CHECKING:  # transformers is imported by whoever built the model
    import transformers


@dataclass
class ModelHandle:
    """A loaded causal LM with its tokenizer, its :class:`ArchitectureAdapter` (``adapter``) and a
    few shape properties (read from the adapter)."""

    model: "transformers.PreTrainedModel"
    tokenizer: "transformers.PreTrainedTokenizerBase"
    spec: str
    name: str
    _adapter: ArchitectureAdapter | None = field(default=None, init=False, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: name, architecture, layers, heads, dtype and device (not the module tree)."""
        try:
            shape = (f"{self.num_layers} layers, {self.num_heads} heads"
                     + (f" ({self.num_kv_heads} kv)" if self.num_kv_heads != self.num_heads else ""))
        except Exception:                                     # an architecture attngeom cannot read
            shape = "attention not read"
        return (f"ModelHandle({self.name or self.spec}: {self.architecture}, {shape}, "
                f"{str(self.dtype).replace('torch.', '')} on {self.device})")

    @property
    def adapter(self) -> ArchitectureAdapter:
        """The model's architecture adapter: attention modules and decoder layers by layer,
        ``W_O`` / ``W_V`` per layer, head geometry (built once per model object)."""
        if self._adapter is None or self._adapter.model is not self.model or not self._adapter.current():
            self._adapter = adapter_for(self.model)
        return self._adapter

    @property
    def config(self):
        """The model's config (for multimodal wrappers, its text config)."""
        return self.model.config.get_text_config(decoder=True)

    @property
    def device(self) -> torch.device:
        """Device of the model's first parameters (its input device)."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating point dtype of the weights."""
        return self.model.dtype

    @property
    def architecture(self) -> str:
        """``config.model_type``, e.g. ``"llama"``."""
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return self.adapter.num_layers

    @property
    def num_heads(self) -> int:
        """Number of query heads per layer."""
        return self.adapter.num_heads

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads per layer (equal to ``num_heads`` without GQA/MQA)."""
        return self.adapter.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head."""
        return self.adapter.head_dim

    @property
    def weights_not_loaded(self) -> dict[str, list[str]]:
        """Weights the checkpoint left random, by kind (``missing``, ``unexpected``, ``of another
        shape``): empty, unless the model was loaded with ``allow_missing_weights=True``
        (:func:`attngeom.model.loading.check_weights`)."""
        return dict(getattr(self.model, "weights_not_loaded", None) or {})

    @property
    def max_positions(self) -> int | None:
        """``config.max_position_embeddings``, or None when the config does not say."""
        mp = getattr(self.config, "max_position_embeddings", None)
        return int(mp) if mp else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids for ``text``, with BOS prepended (when the tokenizer has one) as position 0.

        The tokenizer's own special-token handling is not used (SmolLM2's, for one, adds no BOS);
        BOS is added here unless the text already begins with it, so position 0 is always the
        attention-sink token where the tokenizer defines one.
        """
        if not isinstance(text, str):
            raise InputError(f"text must be a string, not {type(text).__name__}")
        if not text.strip():
            raise InputError("the text is empty (or only whitespace); give some text to analyse")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
        if not ids:
            raise InputError("the text produced no tokens; give some text to analyse")
        return [int(i) for i in ids]

    def tokens(self, ids) -> list[str]:
        """Readable strings for token ids: byte-level markers ('Ġ', 'Ċ', ...) and SentencePiece
        '▁' become the spaces/newlines they stand for; special tokens are kept as written."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        raw = self.tokenizer.convert_ids_to_tokens(ids)
        special = _special_ids(self.tokenizer)
        byte_level = _is_byte_level(self.tokenizer)
        out = []
        for i, tok in zip(ids, raw):
            if tok is None:
                out.append(f"<{i}>")
            elif i in special:
                out.append(tok)
            elif byte_level:
                out.append(_unbyte(tok))
            else:
                out.append(_unsentencepiece(tok))
        return out


def _special_ids(tokenizer) -> set[int]:
    """Ids of special and added tokens (shown verbatim)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, t in decoder.items() if getattr(t, "special", True))
    return ids


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's vocabulary is GPT-2 style byte-level (decoder or pre-tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    parts = [backend.decoder, backend.pre_tokenizer]
    return any(p is not None and "ByteLevel" in repr(p) for p in parts)


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _unbyte(tok: str) -> str:
    """Map a byte-level token string back to text (partial UTF-8 shows as U+FFFD)."""
    table = byte_decoder()
    data = bytearray()
    for ch in tok:
        if ch in table:
            data.append(table[ch])
        else:
            data.extend(ch.encode("utf-8"))
    return data.decode("utf-8", errors="replace")


_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _unsentencepiece(tok: str) -> str:
    """SentencePiece display: '▁' is a space, '<0x0A>' byte-fallback tokens are their byte."""
    m = _BYTE_FALLBACK_RE.match(tok)
    if m:
        b = int(m.group(1), 16)
        return chr(b) if b < 128 else tok
    return tok.replace("▁", " ")


def special_token_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens (BOS, EOS, pad, chat-format markers such as ``<|im_start|>``):
    ``all_special_ids`` and the added tokens marked special."""
    return _special_ids(tokenizer)



@takes_handle
def special_positions(handle, ids) -> tuple[int, ...]:
    """The positions of ``ids`` that hold one of the handle's tokenizer's special tokens."""
    special = special_token_ids(handle.tokenizer)
    return tuple(p for p, i in enumerate(ids) if int(i) in special)
