"""Where a model keeps its attention, found by watching it run: the one place that knows structure (SPEC §1).

attngeom reads q, k and v from the attention call itself (:mod:`attngeom.capture.session`), so what it
needs from the model's structure is small: which modules call transformers' attention interface,
in which order, with how many query and key/value heads of which sizes, and the linear map that
turns the attention output into the residual-stream update (``W_O``, and its bias). For the head
taxonomy it also wants ``W_V``, the map from a layer's input to its values.

**Discovery** (:func:`discover`, once per model, :func:`adapter_for`) runs two forward passes on a
few tokens with a *probe* registered in ``transformers.AttentionInterface`` in place of the
attention function. The probe records each call (module, shapes of q/k/v, keyword arguments) and
returns a known random tensor ``R`` in place of the attention output; hooks then find the module
that receives ``R`` unchanged (the output projection, whatever it is called: ``o_proj``, ``dense``,
``c_proj``, ``out_proj``, ``wo``, a peft LoRA wrapper) and the module under the attention whose
output holds the value states at some rows (the value projection, also inside a fused ``qkv``).
Each map is verified on the probe's own numbers: ``x Wᵀ + b`` (``nn.Linear``), ``x W + b``
(GPT-2's ``Conv1D``), else any module that is affine on the probe (a LoRA adapter that is active),
read column by column. Nothing is guessed from names or configs: what discovery cannot establish
raises :class:`UnsupportedArchitectureError` with one line naming the module and what is missing
(a value projection that cannot be established is not an error: only ``w_v`` refuses then).

Attention layers are numbered ``0 .. n-1`` in the order the model calls them (in a hybrid model
with state-space or linear-attention layers these are only the attention layers;
:attr:`ArchitectureAdapter.decoder_index` maps them to the model's decoder layers). The attention
function, which sees only the module, reads the layer and ``W_O`` through :func:`attention_layer`
and :func:`attention_w_o`: one dictionary look-up, no per-architecture branch.

The norm that receives the attention output before the residual add, where there is one (Gemma 2/3,
OLMo 2), is found the same way (:meth:`ArchitectureAdapter.attention_delta_module`). Discovery runs
once per model and again only when a module it found has been replaced (``adapter.current()``).
:data:`EXCEPTIONS` is for what watching cannot tell (none known: the table is empty).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import weakref
from dataclasses import dataclass
from functools import cached_property

import torch

from attngeom.model.arguments import takes_model
from attngeom.errors import UnsupportedArchitectureError

PROBE_NAME = "attngeom_probe"
PROBE_TOKENS = 6

KNOWN_ATTENTION_KWARGS = frozenset({
    # honoured by attngeom's attention function
    "attention_mask", "dropout", "scaling", "softcap", "s_aux", "sliding_window", "is_causal",
    # bookkeeping that does not change the attention weights
    "position_ids", "cache_position", "output_attentions", "use_cache", "past_key_values",
    "past_key_value", "layer_idx", "position_embeddings", "head_mask", "return_dict",
    "token_type_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
})
"""Keyword arguments of an attention call that attngeom knows (honours, or knows to be irrelevant
to the attention weights). A call that passes any other tensor-valued argument is refused: it
might change the weights (a bias, a second mask) in a way the capture would not reproduce."""

EXCEPTIONS: dict[str, str] = {}
"""``config.model_type`` -> reason, for architectures that discovery would accept but that attngeom
must refuse (none known: every refusal so far is found by discovery itself)."""


@dataclass(frozen=True)
class HeadGeometry:
    """Head counts and sizes of a model's attention layers (the same in every attention layer).

    ``head_dim`` is the value/output head size ``d_h`` of the SPEC (the width of ``W_O^h``);
    ``qk_head_dim`` the query/key head size (they differ in multi-head latent attention)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qk_head_dim: int | None = None

    def __post_init__(self):
        if self.qk_head_dim is None:
            object.__setattr__(self, "qk_head_dim", self.head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (``H / H_kv``; 1 without GQA/MQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self) -> torch.Tensor:
        """The key/value head each query head reads: ``[H]`` long, ``h // group_size``."""
        return torch.arange(self.num_heads) // self.group_size


# --------------------------------------------------------------------------------------------
# Affine maps found on the probe
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """An affine map ``y = x Wᵀ + b`` carried out by ``module``, as the probe verified it.

    ``kind``: ``"linear"`` (``module.weight`` is ``W``, ``[out, in]``), ``"transposed"``
    (``module.weight`` is ``Wᵀ``: GPT-2's ``Conv1D``), ``"affine"`` (any other module, e.g. a peft
    LoRA wrapper with its adapter active: ``W`` is read by applying the module to the unit vectors).
    ``rows``: the output rows that belong to this use (the value rows of a fused ``qkv``), or None."""

    module: torch.nn.Module
    name: str
    kind: str
    in_features: int
    rows: slice | torch.Tensor | None = None

    def _full(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.module
        if self.kind == "linear":
            return m.weight, getattr(m, "bias", None)
        if self.kind == "transposed":
            return m.weight.t(), getattr(m, "bias", None)
        return _affine_map(m, self.in_features)

    def weight(self) -> torch.Tensor:
        """``W`` (``[out, in]``, only ``rows``): a view of the parameter for ``linear`` and
        ``transposed`` maps with contiguous rows."""
        w = self._full()[0]
        return w if self.rows is None else w[self.rows]

    def bias(self) -> torch.Tensor | None:
        """``b`` (``[out]``, only ``rows``), or None when the map has none."""
        b = self._full()[1]
        return b if b is None or self.rows is None else b[self.rows]

    def version(self) -> tuple:
        """Changes whenever a parameter of the map changes (for caches)."""
        return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in self.module.parameters())


def _affine_map(module: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W [out, n], b [out])`` of a module that is affine in its last dimension (width ``n``), by
    applying it to the unit vectors and to zero."""
    p = next(module.parameters())
    with torch.no_grad():
        eye = torch.eye(n + 1, n, dtype=p.dtype, device=p.device)   # n unit vectors, then zero
        y = module(eye[None])                                           # [1, n+1, out]: a sequence of n+1 rows
    if not isinstance(y, torch.Tensor) or y.ndim != 3 or y.shape[:2] != (1, n + 1):
        raise ValueError(f"{type(module).__name__} does not map each row of its input on its own")
    y = y[0]
    b = y[n]
    return (y[:n] - b).t(), b


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """``y`` equals ``ref`` up to the rounding of the dtype they were computed in."""
    if y.shape != ref.shape:
        return False
    tol = 1e-4 if y.dtype in (torch.float32, torch.float64) else 3e-2
    err = (y.double() - ref.double()).norm()
    return bool(err <= tol * ref.double().norm() + 1e-12)


def _verified_projection(module: torch.nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> Projection | None:
    """The kind of affine map ``module`` applied to ``x`` to give ``y`` (last dimension), or None."""
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    n = x2.shape[-1]
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2 and (b is None or isinstance(b, torch.Tensor)):
        with torch.no_grad():
            if tuple(w.shape) == (y2.shape[-1], n) and _close(torch.nn.functional.linear(x2, w, b), y2):
                return Projection(module, name, "linear", n)
            if tuple(w.shape) == (n, y2.shape[-1]):
                z = x2 @ w if b is None else torch.addmm(b, x2, w)
                if _close(z, y2):
                    return Projection(module, name, "transposed", n)
    try:
        W, b0 = _affine_map(module, n)
        with torch.no_grad():
            ok = _close(torch.nn.functional.linear(x2.to(W.dtype), W, b0), y2)
    except Exception:  # noqa: BLE001 - a module that cannot take a plain [n, in] tensor is not a map we know
        return None
    if not ok:
        return None
    proj = Projection(module, name, "affine", n)
    try:  # read it once more the way capture will (a module whose map depends on the call is refused)
        ok = _close(torch.nn.functional.linear(x2.to(W.dtype), proj.weight(), proj.bias()), y2)
    except Exception:  # noqa: BLE001
        ok = False
    return proj if ok else None


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


@dataclass
class _Call:
    module: torch.nn.Module
    q: tuple
    k: tuple
    v: torch.Tensor
    kwargs: dict
    returned: torch.Tensor


_PROBE_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("attngeom_probe", default=None)


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stands in for the attention function during discovery: records the call and returns a known
    random tensor ``[B, T, H, d_v]`` in place of the attention output."""
    calls = _PROBE_CALLS.get()
    B, H, T, _ = query.shape
    g = torch.Generator(device="cpu").manual_seed(1000 + (len(calls) if calls is not None else 0))
    out = torch.randn(B, T, H, value.shape[-1], generator=g).to(dtype=query.dtype, device=query.device)
    if calls is not None:
        kw = dict(kwargs, dropout=dropout, scaling=scaling, attention_mask=attention_mask)
        calls.append(_Call(module, tuple(query.shape), tuple(key.shape), value.detach().clone(), kw, out))
    return out, None


def _register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)


def _all_configs(config):
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            yield sub


def attn_implementation_for(config, requested: str | None, trust_remote_code: bool) -> str | None:
    """The attention implementation a model of ``config`` is loaded with: the user's choice, else
    "sdpa" where the model class supports it, else "eager"."""
    from transformers import AutoModelForCausalLM

    if requested is not None:
        return requested
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None if trust_remote_code else "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Route ``model``'s attention through the function registered as ``name`` for the duration
    of the block, then restore every config's previous choice."""
    previous = [(c, c._attn_implementation) for c in _all_configs(model.config)]
    if all(impl == name for _, impl in previous):
        yield model
        return
    can_set = getattr(model, "_can_set_attn_implementation", None)
    try:
        if can_set is not None and not can_set():
            raise TypeError("the model computes attention in its own code")   # (transformers would log it)
        model.set_attn_implementation(name)
    except Exception:  # noqa: BLE001 - older transformers, or a model that refuses: set the field directly
        for c, _ in previous:
            c._attn_implementation = name
    for c, _ in previous:  # some wrappers leave a sub-config behind
        if c._attn_implementation != name:
            c._attn_implementation = name
    try:
        yield model
    finally:
        for c, impl in previous:
            c._attn_implementation = impl


def _probe_ids(model) -> torch.Tensor:
    vocab = int(getattr(model.config.get_text_config(decoder=True), "vocab_size", 0) or 0)
    ids = torch.arange(PROBE_TOKENS) % max(1, vocab - 4) + 3 if vocab > 8 else torch.zeros(PROBE_TOKENS, dtype=torch.long)
    return ids[None].to(_input_device(model))


def _input_device(model) -> torch.device:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def _run_probe(model, hooks: list | None = None) -> list[_Call]:
    calls: list[_Call] = []
    token = _PROBE_CALLS.set(calls)
    ids = _probe_ids(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), attention_implementation(model, PROBE_NAME):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as e:  # noqa: BLE001 - the model's own code failed around the attention function
        text = str(e).strip().splitlines()
        raise _refuse(model, "its forward fails when attention goes through a registered attention function "
                             f"({type(e).__name__}: {text[0][:120] if text else ''})") from None
    finally:
        _PROBE_CALLS.reset(token)
        for h in hooks or ():
            h.remove()
        model.train(was_training)
    return calls


# --------------------------------------------------------------------------------------------
# What discovery finds
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionSite:
    """One attention module: its place, its output projection and (when found) value projection."""

    layer: int                       # attention-layer number: 0 .. n-1 in calling order
    name: str                        # qualified module name, e.g. "model.layers.3.self_attn"
    module: torch.nn.Module
    decoder_index: int | None        # index in the decoder layers' ModuleList, when there is one
    out: Projection
    value: Projection | None
    value_missing: str | None        # why ``value`` is None
    sliding_window: int | None
    learned_sinks: bool
    delta: torch.nn.Module           # its output is what the attention adds to the residual stream
    heads: tuple[int, int, int, int]  # (H, H_kv, d_v, d_qk) as the attention call received them


_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, Projection]]" = weakref.WeakKeyDictionary()
"""Attention module -> (attention-layer number, output projection), for the attention function."""
_ADAPTERS: "weakref.WeakKeyDictionary[torch.nn.Module, ArchitectureAdapter]" = weakref.WeakKeyDictionary()


def attention_layer(module: torch.nn.Module) -> int:
    """The attention-layer number of an attention module (discovered), else its ``layer_idx``, else -1."""
    site = _SITES.get(module)
    if site is not None:
        return site[0]
    return int(getattr(module, "layer_idx", -1))


def attention_w_o(module: torch.nn.Module) -> torch.Tensor:
    """``W_O`` of an attention module (``[D, H·d]``), as discovery found it; for code that holds the
    module but not the model (the attention function). A module never discovered is refused."""
    site = _SITES.get(module)
    if site is None:
        raise UnsupportedArchitectureError(
            f"{type(module).__name__}: this attention module was not discovered (wrap the model with "
            "attngeom.wrap or load it with attngeom.load_model first)")
    return site[1].weight()


def attention_w_o_version(module: torch.nn.Module) -> tuple:
    """Changes whenever :func:`attention_w_o` of ``module`` would change (for caches)."""
    site = _SITES.get(module)
    return () if site is None else site[1].version()


def _refuse(model, what: str) -> UnsupportedArchitectureError:
    cfg = model.config.get_text_config(decoder=True)
    return UnsupportedArchitectureError(f"{getattr(cfg, 'model_type', type(model).__name__)}: {what}")


def _names(model) -> dict[torch.nn.Module, str]:
    out: dict[torch.nn.Module, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out.setdefault(m, name)
    return out


def _decoder_place(model, name: str) -> tuple[str | None, int | None]:
    """``("model.layers", 3)`` for ``"model.layers.3.self_attn"`` (the innermost ModuleList index)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if re.fullmatch(r"\d+", parts[i]):
            prefix = ".".join(parts[:i])
            try:
                container = model.get_submodule(prefix)
            except AttributeError:
                continue
            if isinstance(container, torch.nn.ModuleList):
                return prefix, int(parts[i])
    return None, None


def _parent(model, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


@takes_model
def discover(model) -> list[AttentionSite]:
    """The attention sites of ``model`` in calling order (two probe forwards on a few tokens)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise _refuse(model, "encoder-decoder models are not supported (attngeom analyses decoder-only causal LMs)")
    _register_probe()
    names = _names(model)
    calls = _run_probe(model)
    if not calls:
        raise _refuse(model, "no module calls transformers' attention interface (the model computes attention "
                             "in its own code, or has none), so attngeom cannot capture it")
    order: list[torch.nn.Module] = []
    for c in calls:
        if c.module in order:
            raise _refuse(model, f"{names.get(c.module, type(c.module).__name__)} calls the attention function "
                                 "more than once per forward (shared or repeated attention blocks are not supported)")
        order.append(c.module)
    _check_calls(model, calls, names)

    # second pass: hooks on everything near each attention module
    seen_in: dict[torch.nn.Module, torch.Tensor] = {}
    io: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    watched: set = set()
    for m in order:
        hooks.append(m.register_forward_pre_hook(_record_input(seen_in), with_kwargs=True))
        for sub in _parent(model, names[m]).modules():
            if sub not in watched:
                watched.add(sub)
                hooks.append(sub.register_forward_hook(_record_io(io), with_kwargs=True))
    calls2 = _run_probe(model, hooks)
    if [c.module for c in calls2] != order:
        raise _refuse(model, "the attention modules are not called in the same order on two identical forwards")

    sites = []
    for layer, c in enumerate(calls2):
        sites.append(_site(model, layer, c, names, io, seen_in.get(c.module)))
    return sites


def _check_calls(model, calls: list[_Call], names) -> None:
    first = calls[0]
    for c in calls:
        where = names.get(c.module, type(c.module).__name__)
        unknown = [k for k, v in c.kwargs.items()
                   if k not in KNOWN_ATTENTION_KWARGS and isinstance(v, torch.Tensor)]
        if unknown:
            raise _refuse(model, f"{where} passes {unknown[0]!r} to the attention function, which attngeom "
                                 "does not know how to honour")
        mask = c.kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and (mask.ndim != 4 or mask.shape[1] != 1 or (
                mask.is_floating_point() and bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any()))):
            raise _refuse(model, f"{where} passes an attention mask that carries a bias (per head, such as ALiBi "
                                 "or a dynamic mask), which attngeom does not capture")
        if c.kwargs.get("is_causal") is False:
            raise _refuse(model, f"{where} asks for non-causal attention (is_causal=False)")
        B, H, T, dqk = c.q
        Hkv = c.k[1]
        if c.k[2] != T:
            raise _refuse(model, f"{where} attends from {T} queries to {c.k[2]} keys of another sequence "
                                 "(cross-attention; attngeom analyses causal self-attention)")
        if c.v.shape[1] != Hkv or H % Hkv:
            raise _refuse(model, f"{where} has {H} query heads, {Hkv} key heads and {c.v.shape[1]} value heads "
                                 "(attngeom needs value heads = key heads dividing the query heads)")
        if c.k[-1] != dqk:
            raise _refuse(model, f"{where}: query and key head sizes differ ({dqk} vs {c.k[-1]})")
        if (c.q[1], c.k[1], c.q[-1], c.v.shape[-1]) != (first.q[1], first.k[1], first.q[-1], first.v.shape[-1]):
            raise _refuse(model, f"{where} has {H} query / {Hkv} key-value heads of sizes {dqk}/{c.v.shape[-1]}, "
                                 f"other layers {first.q[1]} / {first.k[1]} of sizes {first.q[-1]}/{first.v.shape[-1]} "
                                 "(attngeom needs the same head geometry in every attention layer)")


def _record_input(store):
    def hook(module, args, kwargs):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor):
            store[module] = x.detach()
    return hook


def _record_io(store):
    def hook(module, args, kwargs, output):
        x = args[0] if args else next(iter(kwargs.values()), None)
        y = output[0] if isinstance(output, tuple) and output else output
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and module not in store:
            store[module] = (x.detach(), y.detach())
    return hook


def _outermost(found: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o, _ in found)]


def _site(model, layer: int, call: _Call, names, io, hidden) -> AttentionSite:
    module = call.module
    name = names[module]
    B, T, H, dv = call.returned.shape
    R = call.returned.reshape(B, T, H * dv)
    parent = _parent(model, name)
    receivers = [(names.get(m, "?"), m) for m in parent.modules()
                 if m in io and io[m][0].shape == R.shape and torch.equal(io[m][0], R)
                 and not isinstance(m, torch.nn.Dropout)]
    receivers = _outermost(receivers)
    if not receivers:
        raise _refuse(model, f"{name}: no module receives the attention output unchanged (it is gated, "
                             "normalised or mixed before the output projection), so W_O cannot be established")
    if len(receivers) > 1:
        raise _refuse(model, f"{name}: several modules receive the attention output "
                             f"({', '.join(n for n, _ in receivers)}); the output projection is ambiguous")
    out_name, out_module = receivers[0]
    x, y = io[out_module]
    out = _verified_projection(out_module, out_name, x, y)
    if out is None:
        raise _refuse(model, f"{out_name} receives the attention output but is not an affine map of it (a norm or "
                             "gate before the output projection), so W_O cannot be established")
    value, missing = _value_projection(module, call, names, io, hidden)
    decoder_prefix, decoder_index = _decoder_place(model, name)
    window = call.kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return AttentionSite(
        layer=layer, name=name, module=module, decoder_index=decoder_index, out=out, value=value,
        value_missing=missing, sliding_window=int(window) if window else None,
        learned_sinks=isinstance(call.kwargs.get("s_aux"), torch.Tensor),
        delta=_delta_module(model, name, module, io),
        heads=(call.q[1], call.k[1], int(call.v.shape[-1]), call.q[-1]))


def _value_projection(module, call: _Call, names, io, hidden) -> tuple[Projection | None, str | None]:
    """The module under the attention that maps its input to the value states (verified rows)."""
    v = call.v.float()                                          # [B, Hkv, T, dv]
    if hidden is None:
        return None, "the attention module's input was not seen"
    if not bool(v.abs().amax() > 0):
        return None, "the value states are all zero on the probe"
    found = []
    for m in module.modules():
        if m is module or m not in io:
            continue
        x, y = io[m]
        if x.shape != hidden.shape or not torch.equal(x, hidden) or y.ndim != 3 or y.shape[:2] != hidden.shape[:2]:
            continue
        rows = _value_rows(y.float(), v)
        if rows is not None:
            found.append((names.get(m, "?"), m, rows))
    outer = {n for n, _ in _outermost([(n, m) for n, m, _ in found])}
    found = [f for f in found if f[0] in outer]
    if len(found) != 1:
        return None, ("no module under the attention maps its input to the value states (the values are "
                      "normalised, shared with another layer or read from a compressed latent)" if not found else
                      "several modules give the value states")
    name, m, rows = found[0]
    proj = _verified_projection(m, name, *io[m])
    if proj is None:
        return None, f"{name} is not an affine map of the attention input"
    return Projection(m, name, proj.kind, proj.in_features, rows), None


def _value_rows(y: torch.Tensor, v: torch.Tensor) -> slice | torch.Tensor | None:
    """Rows of ``y [B, T, out]`` that hold ``v [B, Hkv, T, dv]`` (kv head by kv head), or None."""
    B, Hkv, T, dv = v.shape
    if y.shape[-1] < Hkv * dv:
        return None
    windows = y.unfold(-1, dv, 1)                               # [B, T, out-dv+1, dv]
    starts = []
    for g in range(Hkv):
        target = v[:, g][:, :, None, :]                         # [B, T, 1, dv]
        err = (windows - target).abs().amax(dim=(0, 1, 3))      # [out-dv+1]
        scale = float(target.abs().amax()) + 1e-12
        hits = (err <= 1e-5 * scale).nonzero().flatten().tolist()
        if len(hits) != 1:
            return None
        starts.append(hits[0])
    if all(s == starts[0] + g * dv for g, s in enumerate(starts)):
        return slice(starts[0], starts[0] + Hkv * dv)
    return torch.cat([torch.arange(s, s + dv) for s in starts])


def _delta_module(model, name: str, module, io) -> torch.nn.Module:
    """The module whose output is what the attention adds to the residual stream: the attention
    module, or a norm of the decoder layer that receives its output unchanged (Gemma 2/3, OLMo 2)."""
    if module not in io:
        return module
    out = io[module][1]
    parent = _parent(model, name)
    for child in parent.children():
        if child is module or isinstance(child, torch.nn.Dropout) or child not in io:
            continue
        x, _ = io[child]
        if x.shape == out.shape and torch.equal(x, out) and not any(True for _ in child.children()):
            return child
    return module


# --------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------


class ArchitectureAdapter:
    """Structure of one loaded model, by attention layer (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)   # the adapter lives as long as the model, never longer
        self.config = model.config.get_text_config(decoder=True)
        if self.architecture in EXCEPTIONS:
            raise _refuse(model, EXCEPTIONS[self.architecture])
        self.sites = discover(model)
        for site in self.sites:
            _SITES[site.module] = (site.layer, site.out)   # (nothing in the value refers to the key)
        # (parent, attribute, module) of every module found: checked before each forward (cheaply)
        self._anchors = [(_parent(model, name), name.rsplit(".", 1)[-1], module)
                         for s in self.sites for name, module in ((s.name, s.module), (s.out.name, s.out.module))]
        first = self.sites[0]
        w_o = first.out.weight()
        H = first.heads
        self.geometry = HeadGeometry(
            num_layers=len(self.sites), num_heads=H[0], num_kv_heads=H[1], head_dim=H[2],
            hidden_size=int(w_o.shape[0]), qk_head_dim=H[3])

    def __repr__(self) -> str:
        g = self.geometry
        return (f"{type(self).__name__}({self.architecture}: {g.num_layers} attention layers, {g.num_heads} heads, "
                f"{g.num_kv_heads} kv heads, head_dim {g.head_dim})")

    @property
    def model(self) -> torch.nn.Module:
        """The model (the adapter holds it weakly: a model dropped by its user is freed)."""
        return self._model()

    def current(self) -> bool:
        """Whether the modules found are still where discovery found them (a module replaced since,
        e.g. by peft's ``merge_and_unload`` or ``get_peft_model``, means discovering again)."""
        return all(parent._modules.get(attr) is module for parent, attr, module in self._anchors)

    # ---- geometry ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """``config.model_type``."""
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        """Number of attention layers."""
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
    def decoder_index(self) -> list[int | None]:
        """The decoder layer of each attention layer (equal to the attention layer number, unless
        the model has layers without attention: hybrid models)."""
        return [s.decoder_index for s in self.sites]

    @property
    def hybrid(self) -> bool:
        """Whether some decoder layers have no attention (state-space or linear-attention layers)."""
        layers = self.decoder_layers
        return layers is not None and len(layers) != len(self.sites)

    @property
    def layer_types(self) -> list[str]:
        """``"sliding_attention"`` or ``"full_attention"`` per attention layer."""
        return ["full_attention" if self.sliding_window(l) is None else "sliding_attention"
                for l in range(self.num_layers)]

    def sliding_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention (as its attention call passes it, else the
        module's own), or None for global attention."""
        return self._site(layer).sliding_window

    def learned_sinks(self, layer: int) -> bool:
        """Whether ``layer``'s softmax has learned sink logits (gpt-oss ``sinks``)."""
        return self._site(layer).learned_sinks

    # ---- modules -------------------------------------------------------------------------------

    def _site(self, layer: int) -> AttentionSite:
        if not 0 <= int(layer) < len(self.sites):
            raise IndexError(f"no attention layer {layer}; the model has attention layers 0..{len(self.sites) - 1}")
        return self.sites[int(layer)]

    @cached_property
    def attention_modules(self) -> dict[int, torch.nn.Module]:
        """Attention modules by attention-layer number, in order."""
        return {s.layer: s.module for s in self.sites}

    def attention(self, layer: int) -> torch.nn.Module:
        """The attention module of ``layer``."""
        return self._site(layer).module

    @cached_property
    def decoder_layers(self) -> list[torch.nn.Module] | None:
        """The decoder layers in order (the ModuleList that holds the attention modules), or None."""
        prefixes = set()
        for s in self.sites:
            prefix, _ = _decoder_place(self.model, s.name)
            prefixes.add(prefix)
        if len(prefixes) != 1 or None in prefixes:
            return None
        return list(self.model.get_submodule(prefixes.pop()))

    def decoder_layer(self, layer: int) -> torch.nn.Module | None:
        """The decoder layer that holds attention layer ``layer``, or None."""
        layers, index = self.decoder_layers, self._site(layer).decoder_index
        return None if layers is None or index is None else layers[index]

    def attention_delta_module(self, layer: int) -> torch.nn.Module:
        """The module whose output (first element, if a tuple) is what ``layer``'s attention adds to
        the residual stream: the attention module itself, or the norm that receives its output
        (Gemma 2/3's and OLMo 2's ``post_attention_layernorm``)."""
        return self._site(layer).delta

    # ---- weights -------------------------------------------------------------------------------

    def o_proj(self, layer: int) -> torch.nn.Module:
        """The output projection module of ``layer`` (whatever the model calls it)."""
        return self._site(layer).out.module

    def w_o(self, layer: int) -> torch.Tensor:
        """``W_O`` of ``layer``: ``[D, H·d]`` (head ``h`` owns columns ``h·d .. (h+1)·d``); the weight
        parameter itself for an ``nn.Linear``, its transpose (a view) for a ``Conv1D``."""
        return self._site(layer).out.weight()

    def b_o(self, layer: int) -> torch.Tensor | None:
        """The output-projection bias of ``layer`` (``[D]``), or None. It is added once to the layer
        output and belongs to no source token (SPEC §1)."""
        return self._site(layer).out.bias()

    def w_v(self, layer: int) -> torch.Tensor:
        """``W_V`` of ``layer``: ``[H_kv·d, D]`` (kv head ``g`` owns rows ``g·d .. (g+1)·d``); a view of
        the model's weight where the rows are contiguous. Refused (one line) when discovery could not
        establish a value projection that reads the attention input."""
        return self._value(layer).weight()

    def b_v(self, layer: int) -> torch.Tensor | None:
        """The value bias of ``layer`` (``[H_kv·d]``), or None."""
        return self._value(layer).bias()

    def _value(self, layer: int) -> Projection:
        site = self._site(layer)
        if site.value is None:
            raise _refuse(self.model, f"{site.name}: W_V cannot be established: {site.value_missing}")
        return site.value

    def w_o_heads(self, layer: int) -> torch.Tensor:
        """``W_O`` split by head, float32: ``[H, d, D]`` (``W_O^h`` transposed)."""
        g = self.geometry
        return self.w_o(layer).detach().float().t().reshape(g.num_heads, g.head_dim, -1)

    def w_v_heads(self, layer: int) -> torch.Tensor:
        """``W_V`` split by kv head, float32: ``[H_kv, d, D]``."""
        g = self.geometry
        return self.w_v(layer).detach().float().reshape(g.num_kv_heads, g.head_dim, -1)


SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "bamba", "biogpt", "codegen", "cohere", "cohere2",
    "cohere2_moe", "cohere_compass_text", "ctrl", "cwm", "dbrx", "deepseek_v2", "deepseek_v3", "dots1", "emu3",
    "ergo", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_h1", "flex_olmo",
    "flint", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt-sw3",
    "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "jamba", "kimi_linear", "kolibri1", "lara_mini", "lfm2", "lfm2_moe", "llama",
    "llama4_text", "longcat_flash", "mellum", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "mllama", "modernbert-decoder", "moshi", "nanochat", "nemotron", "nemotron_h",
    "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "opt", "param2moe", "persimmon", "phi", "phi3",
    "phi4_multimodal", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "sarvam_mla", "sarvam_moe", "seed_oss",
    "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "youtu", "zamba", "zamba2", "zaya",
)
"""``config.model_type`` values that tests/models/test_architectures.py verifies (docs/architectures.md; the
test fails when this list and its own result differ). Any other decoder-only model whose attention
discovery establishes is accepted too: this list is what is known to be exact, not a gate."""


def check_supported(config) -> None:
    """Refuse, before any weight is loaded, what can be told from the config alone: encoder-decoder
    models and known exceptions (:data:`EXCEPTIONS`). Everything else is decided by discovery once
    the model is loaded (a class's ``_supports_attention_backend`` flag is not reliable: many models
    that call the attention interface do not set it)."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"{model_type}: encoder-decoder models are not supported (attngeom analyses decoder-only causal LMs)")
    if model_type in EXCEPTIONS:
        raise UnsupportedArchitectureError(f"{model_type}: {EXCEPTIONS[model_type]}")


@takes_model
def adapter_for(model: torch.nn.Module) -> ArchitectureAdapter:
    """The adapter of ``model``: discovered on first use, then kept as long as the model lives."""
    adapter = _ADAPTERS.get(model)
    if adapter is None or not adapter.current():
        adapter = _ADAPTERS[model] = ArchitectureAdapter(model)
    return adapter
