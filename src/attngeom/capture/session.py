"""The session and the switch onto the plug-in: one attention function in transformers' attention registry.

attngeom registers an attention function under the name ``"attngeom"`` in
``transformers.AttentionInterface`` and the matching mask builder (the boolean SDPA mask) in
``AttentionMaskInterface``. Every supported architecture's attention module calls it with its own
q, k, v (after RoPE, q/k norms, biases), its mask (causal, padding, sliding window as the model
defines them), its scaling and soft-capping; learned sink logits (the call's ``s_aux``: gpt-oss) are
honoured as a virtual source of zero value (SPEC §1).

With no :class:`Session` active the function is plain SDPA (or, where SDPA cannot express the
layer, the exact blocked kernel, :func:`attngeom.capture.kernel.exact_attention`), so a model left on
``"attngeom"`` behaves as usual. Inside :meth:`Session.active` the kernel computes attention in blocks
of queries, hands each block (:class:`attngeom.capture.blocks.Block`) to the session's *observers*
(which reduce metrics as they go) and lets an optional *intervention* edit the weights that mix the
values (no renormalisation, SPEC §3). :func:`current_session` is the session active in this context.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Iterable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngeom.capture.blocks import Intervention, Observer
from attngeom.capture.routes import check_route
from attngeom.capture.kernel import MIN_BLOCK_QUERIES, Workspace, default_block_elements, exact_attention
from attngeom.data.corpora import check_layers
from attngeom.model.adapter import adapter_for, attention_implementation
from attngeom.model.arguments import takes_model

ATTN_NAME = "attngeom"

_SESSION: contextvars.ContextVar["Session | None"] = contextvars.ContextVar("attngeom_session", default=None)


def current_session() -> "Session | None":
    """The session active in this context (inside :meth:`Session.active`), or None."""
    return _SESSION.get()


class Session:
    """Observers and an intervention active for the forward passes run inside :meth:`active`.

    ``layers``: the attention layers (``attngeom.model.adapter.attention_layer``) observed and intervened on;
    None means all. Layers outside it still run through the exact blocked path, unobserved.
    ``block_elements`` bounds ``B*H*Q*S`` per block of queries (None: :func:`~attngeom.capture.kernel.default_block_elements`
    of each layer's device, so a model split over devices gets each device's own).
    ``prepared``: ``{layer: {metric: map}}`` of the measures computed before this forward
    (:func:`attngeom.capture.prepared.prepare`), read by :meth:`Block.prepared`.
    ``route`` (SPEC §10, :data:`attngeom.capture.routes.ROUTES`): ``"auto"`` (the fused route on CUDA,
    blocks on the CPU), ``"fused"`` (wherever it is exact) or ``"block"``; :attr:`routes` holds the
    route each observed layer took in the last forward, why a layer took blocks
    (:func:`attngeom.capture.routes.layer_route`), and a fused layer that took its mask whole
    (:data:`attngeom.capture.routes.WHOLE_MASK_ROUTE`)."""

    def __init__(
        self,
        observers: Iterable[Observer] = (),
        intervention: Intervention | None = None,
        layers: Iterable[int] | None = None,
        block_elements: int | None = None,
        prepared: dict[int, dict[str, torch.Tensor]] | None = None,
        route: str = "auto",
    ):
        self.prepared = prepared or {}
        self.route = check_route(route)
        self.routes: dict[int, str] = {}
        self.observers = list(observers)
        self.intervention = intervention
        layers = check_layers(layers)       # whole numbers from 0; the model's range: check
        self.layers = None if layers is None else set(layers)
        self.block_elements = None if block_elements is None else int(block_elements)
        # the default budget keeps at least MIN_BLOCK_QUERIES queries per block: at long inputs a
        # fixed budget would leave a handful of queries per block and per-block overhead would dominate
        self.min_queries = MIN_BLOCK_QUERIES if block_elements is None else 1
        self.lengths: torch.Tensor | None = None
        self.layers_seen: list[int] = []
        self.workspace = Workspace()

    def budget(self, device: torch.device | str) -> int:
        """``B*H*Q*S`` per block for a layer on ``device``: the session's ``block_elements``, or
        :func:`~attngeom.capture.kernel.default_block_elements`."""
        return default_block_elements(device) if self.block_elements is None else self.block_elements

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def check(self, num_layers: int) -> None:
        """Refuse, before a forward pass of a model with ``num_layers`` attention layers, layers it
        does not have (:func:`attngeom.data.corpora.check_layers`, the command line's check)."""
        check_layers(None if self.layers is None else sorted(self.layers), num_layers)

    @contextlib.contextmanager
    def active(self, lengths: torch.Tensor):
        """Make this session the one the attention function reports to."""
        self.lengths = lengths
        self.layers_seen = []
        token = _SESSION.set(self)
        try:
            yield self
        finally:
            _SESSION.reset(token)


def attngeom_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """The function registered as ``"attngeom"`` in ``transformers.AttentionInterface``."""
    session = current_session()
    sinks = kwargs.pop("s_aux", None)
    if session is None and softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout and module.training:
        raise RuntimeError("attngeom computes attention in eval mode only (dropout > 0 while training)")
    return exact_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                           session=session, sinks=sinks, window=kwargs.get("sliding_window")), None


AttentionInterface.register(ATTN_NAME, attngeom_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


# --------------------------------------------------------------------------------------------
# Switching a model onto the plug-in
# --------------------------------------------------------------------------------------------


@takes_model
@contextlib.contextmanager
def attngeom_attention_implementation(model):
    """Route ``model``'s attention through the plug-in for the duration of the block, then restore.
    The model's attention is discovered first (once per model: :func:`attngeom.model.adapter.adapter_for`),
    so a model attngeom cannot capture is refused before anything runs. A model in training mode
    (dropout active) is put in eval mode, with one line on stderr (:func:`in_eval_mode`)."""
    in_eval_mode(model)
    adapter_for(model)
    with attention_implementation(model, ATTN_NAME):
        yield model


def in_eval_mode(model) -> None:
    """Put ``model`` in eval mode when it, or any of its modules, is in training mode, and say so in
    one line on stderr: attngeom's metrics are those of the model as it predicts (no dropout), and it
    stays in eval mode afterwards, as ``load_model`` and ``wrap`` leave it."""
    if any(m.training for m in model.modules()):
        model.eval()
        sys.stderr.write("attngeom: the model was in training mode (dropout active); it is now in eval mode "
                         "(model.eval()) for the analysis\n")
        sys.stderr.flush()
