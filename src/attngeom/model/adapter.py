"""Where each supported architecture keeps its attention: the one place that knows module names.

An :class:`ArchitectureAdapter` is bound to one model (``handle.adapter``) and answers, by layer
index: the attention module, the decoder layer, ``W_O`` (the ``o_proj`` weight, ``[D, H·d]``) and
``W_V`` (``[H_kv·d, D]``: the ``v_proj`` weight, or the value rows of a fused ``qkv_proj``), and the
head geometry (:class:`HeadGeometry`). Nothing here wraps or replaces a module's ``forward``; the
adapter only reads the model's structure.

Layouts are classes: :class:`SeparateQKVAdapter` (``q_proj``/``k_proj``/``v_proj``/``o_proj``:
LLaMA, Mistral, Qwen2/3, Gemma), its :class:`SandwichNormAdapter` (Gemma 2/3: a norm between attention
and the residual add) and :class:`FusedQKVAdapter` (``qkv_proj`` + ``o_proj``: Phi-3).
:data:`ADAPTERS` maps ``config.model_type`` to its class; a model type not listed (e.g. remote code)
gets the layout its attention modules show. The attention function, which sees only the attention
module, reads ``W_O`` through :func:`attention_w_o`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import UnsupportedArchitectureError

_DECODER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers", "layers",
                  "transformer.h")


@dataclass(frozen=True)
class HeadGeometry:
    """Head counts and sizes of a model's attention (the same in every layer)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (``H / H_kv``; 1 without GQA/MQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self) -> torch.Tensor:
        """The key/value head each query head reads: ``[H]`` long, ``h // group_size``."""
        return torch.arange(self.num_heads) // self.group_size

    @classmethod
    def from_config(cls, config) -> "HeadGeometry":
        """From a text config (``num_key_value_heads`` and ``head_dim`` may be absent or None)."""
        heads = int(config.num_attention_heads)
        kv = getattr(config, "num_key_value_heads", None)
        hd = getattr(config, "head_dim", None)
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(kv) if kv else heads,
            head_dim=int(hd) if hd else int(config.hidden_size) // heads,
            hidden_size=int(config.hidden_size),
        )


class ArchitectureAdapter:
    """Structure of one loaded model, by layer index. Subclasses fix where ``W_V`` lives."""

    layout = "abstract"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.geometry = HeadGeometry.from_config(self.config)

    def __repr__(self) -> str:
        g = self.geometry
        return (f"{type(self).__name__}({self.architecture}: {g.num_layers} layers, {g.num_heads} heads, "
                f"{g.num_kv_heads} kv heads, head_dim {g.head_dim})")

    # ---- geometry ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """``config.model_type``."""
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_heads(self) -> int:
        return self.geometry.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.geometry.head_dim

    @property
    def group_size(self) -> int:
        return self.geometry.group_size

    @property
    def layer_types(self) -> list[str]:
        """``"sliding_attention"`` or ``"full_attention"`` per layer (from the modules' own
        ``sliding_window``, else the config's)."""
        return ["full_attention" if self.sliding_window(l) is None else "sliding_attention"
                for l in range(self.num_layers)]

    def sliding_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, or None for global attention."""
        attn = self.attention(layer)
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        else:
            window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None

    # ---- modules -------------------------------------------------------------------------------

    @cached_property
    def attention_modules(self) -> dict[int, torch.nn.Module]:
        """Attention modules by ``layer_idx`` (modules with a ``layer_idx`` and an ``o_proj``), in
        layer order."""
        found = {int(m.layer_idx): m for m in self.model.modules()
                 if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
        return dict(sorted(found.items()))

    def attention(self, layer: int) -> torch.nn.Module:
        """The attention module of ``layer``."""
        try:
            return self.attention_modules[int(layer)]
        except KeyError:
            raise IndexError(f"no attention module for layer {layer}; the model has layers "
                             f"0..{self.num_layers - 1}") from None

    @cached_property
    def decoder_layers(self) -> list[torch.nn.Module] | None:
        """The decoder layers in order (``model.model.layers`` and similar), or None when the model
        keeps them elsewhere."""
        for path in _DECODER_PATHS:
            obj = self.model
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, torch.nn.ModuleList) and len(obj):
                return list(obj)
        return None

    def attention_delta_module(self, layer: int) -> torch.nn.Module:
        """The module whose output (first element, if a tuple) is what ``layer``'s attention adds to
        the residual stream: the attention module itself, or the norm that follows it where the
        architecture has one (Gemma 2/3's ``post_attention_layernorm``)."""
        return self.attention(layer)

    # ---- weights -------------------------------------------------------------------------------

    def o_proj(self, layer: int) -> torch.nn.Linear:
        """The output projection of ``layer``."""
        return self.attention(layer).o_proj

    def w_o(self, layer: int) -> torch.Tensor:
        """``W_O`` of ``layer``: the ``o_proj`` weight parameter itself, ``[D, H·d]`` (head ``h``
        owns columns ``h·d .. (h+1)·d``)."""
        return attention_w_o(self.attention(layer))

    def w_v(self, layer: int) -> torch.Tensor:
        """``W_V`` of ``layer``: ``[H_kv·d, D]`` (kv head ``g`` owns rows ``g·d .. (g+1)·d``); a view of
        the model's weight."""
        return self.attention_w_v(self.attention(layer))

    def b_v(self, layer: int) -> torch.Tensor | None:
        """The value bias of ``layer`` (``[H_kv·d]``), or None (most architectures have none; Qwen2
        has one)."""
        return self.attention_b_v(self.attention(layer))

    def attention_w_v(self, attn: torch.nn.Module) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def attention_b_v(self, attn: torch.nn.Module) -> torch.Tensor | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def w_o_heads(self, layer: int) -> torch.Tensor:
        """``W_O`` split by head, float32: ``[H, d, D]`` (``W_O^h`` transposed)."""
        g = self.geometry
        return self.w_o(layer).detach().float().t().reshape(g.num_heads, g.head_dim, -1)

    def w_v_heads(self, layer: int) -> torch.Tensor:
        """``W_V`` split by kv head, float32: ``[H_kv, d, D]``."""
        g = self.geometry
        return self.w_v(layer).detach().float().reshape(g.num_kv_heads, g.head_dim, -1)


class SeparateQKVAdapter(ArchitectureAdapter):
    """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (LLaMA, Mistral, Qwen2/3, Gemma 1/2/3)."""

    layout = "separate"

    def attention_w_v(self, attn: torch.nn.Module) -> torch.Tensor:
        return attn.v_proj.weight

    def attention_b_v(self, attn: torch.nn.Module) -> torch.Tensor | None:
        return attn.v_proj.bias


class SandwichNormAdapter(SeparateQKVAdapter):
    """Separate projections, and a norm after attention before the residual add (Gemma 2/3:
    ``post_attention_layernorm``, then ``pre_feedforward_layernorm`` before the MLP)."""

    layout = "separate_sandwich_norm"

    def attention_delta_module(self, layer: int) -> torch.nn.Module:
        layers = self.decoder_layers
        if layers is None:
            raise ValueError(f"{self.architecture}: decoder layers not found")
        return layers[int(layer)].post_attention_layernorm


class FusedQKVAdapter(ArchitectureAdapter):
    """One ``qkv_proj`` with rows ``[q (H·d) | k (H_kv·d) | v (H_kv·d)]``, and ``o_proj`` (Phi-3)."""

    layout = "fused_qkv"

    def _value_rows(self, attn: torch.nn.Module) -> slice:
        g = self.geometry
        start = (g.num_heads + g.num_kv_heads) * g.head_dim
        rows = attn.qkv_proj.weight.shape[0]
        if rows != start + g.num_kv_heads * g.head_dim:
            raise ValueError(f"qkv_proj has {rows} rows; expected {start + g.num_kv_heads * g.head_dim} for {g}")
        return slice(start, rows)

    def attention_w_v(self, attn: torch.nn.Module) -> torch.Tensor:
        return attn.qkv_proj.weight[self._value_rows(attn)]

    def attention_b_v(self, attn: torch.nn.Module) -> torch.Tensor | None:
        bias = attn.qkv_proj.bias
        return None if bias is None else bias[self._value_rows(attn)]


ADAPTERS: dict[str, type[ArchitectureAdapter]] = {
    "llama": SeparateQKVAdapter,
    "mistral": SeparateQKVAdapter,
    "qwen2": SeparateQKVAdapter,
    "qwen3": SeparateQKVAdapter,
    "gemma": SeparateQKVAdapter,
    "gemma2": SandwichNormAdapter,
    "gemma3_text": SandwichNormAdapter,
    "phi3": FusedQKVAdapter,
}
"""``config.model_type`` -> adapter class, for every supported architecture."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ADAPTERS)
"""``config.model_type`` values whose attention attngeom captures exactly."""


def check_supported(config) -> None:
    """Raise UnsupportedArchitectureError unless ``config.model_type`` is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_ARCHITECTURES:
        return
    raise UnsupportedArchitectureError(
        f"model architecture {model_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. attngeom captures attention through transformers' "
        "AttentionInterface; an architecture whose attention module calls the registered attention "
        "function with q, k, v and has an `o_proj` output projection can be added to "
        "SUPPORTED_ARCHITECTURES (an entry of attngeom.model.adapter.ADAPTERS) after its reconstruction "
        "test passes — see tests/test_capture.py"
    )


def adapter_for(model: torch.nn.Module) -> ArchitectureAdapter:
    """The adapter for ``model``: by its model type, else by the layout its attention modules show."""
    model_type = model.config.get_text_config(decoder=True).model_type
    cls = ADAPTERS.get(model_type)
    if cls is None:
        fused = any(hasattr(m, "qkv_proj") and hasattr(m, "o_proj") for m in model.modules())
        cls = FusedQKVAdapter if fused else SeparateQKVAdapter
    return cls(model)


def attention_w_o(attn: torch.nn.Module) -> torch.Tensor:
    """``W_O`` of an attention module (its ``o_proj`` weight, ``[D, H·d]``): every supported layout
    names it ``o_proj``. For code that holds the module but not the model (the attention function)."""
    return attn.o_proj.weight
