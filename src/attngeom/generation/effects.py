"""What a head does to the answer: direct and total effects, and patching (docs/generation.md).
The table that ranks heads by effect with their share beside it is
:func:`attngeom.traces.effects.head_effects` (it reads the shares from a trace).

A share (:mod:`attngeom.generation.heads`) says how much of a layer's attention output a head
carries; it is not a cause. For the next token after a text, predicted at the text's last row
``i = T - 1``, with the **answer metric** ``m`` = ``log P(target)``, or with a ``contrast`` token the
logit difference ``z_target − z_contrast``:

- **direct effect** of head ``h`` of layer ``l``: its output at row ``i`` through the residual stream
  straight to the unembedding, ``(W_O^h o_i^h) ⊙ k_l ⊙ k_f · (U_target − U_contrast)`` (without a
  contrast: ``U_target``), in logit units. Every norm on the way is **linearised at the run's scale**:
  ``k_f`` is the final RMS norm's ``g / rms(x_i)`` at the run's residual ``x_i`` (frozen), ``k_l`` the
  same for a norm that receives the attention output before the residual add (Gemma 2/3), else 1.
  The direct effects of all heads sum to the target's (pre-soft-cap) logit, or logit difference,
  minus the terms that do not come from attention heads (embeddings, MLPs, output-projection biases);
- **total effect**: ``m(clean) − m(head ablated)``, the head removed by the capture's own
  intervention in every position (:class:`~attngeom.capture.interventions.HeadRemoval`, ``zero``: its
  output 0; :class:`~attngeom.capture.interventions.HeadMeanRemoval`, ``mean``: the mean of its
  outputs up to each position). Positive: the head supports the target (against the contrast).

- :func:`direct_effects` / :func:`direct_effects_at` — direct effects and the logit they decompose;
  :func:`answer_direct_effects` — at each generated token's producing row (the answer tables).
- :func:`ablated_scores` — the answer metric with each head ablated alone.
- :func:`head_inputs` / :func:`patched_logits` — each head's output (its slice of the output
  projection's input) recorded from one run and patched into another (:mod:`attngeom.traces.compare`).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.errors import InputError
from attngeom.model.arguments import takes_handle

ABLATIONS = ("zero", "mean")
"""How a head is removed (module docstring)."""
DEFAULT_BATCH = 16
"""Ablated (or patched) copies of the text per forward."""


# --------------------------------------------------------------------------------------------
# The answer: a target token, against an optional contrast
# --------------------------------------------------------------------------------------------


def token_id(handle, token, name: str = "target") -> int:
    """One token: an id, or a string the tokenizer makes into exactly one token (e.g. ``" Paris"``,
    its leading space included); else a one-line :class:`InputError`."""
    from attngeom.streaming.passes import vocabulary_size

    V = vocabulary_size(handle)
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        if not 0 <= int(token) < V:
            raise InputError(f"{name} id {int(token)} is not a token of the model (0..{V - 1})")
        return int(token)
    if not isinstance(token, str) or not token:
        raise InputError(f"{name} must be a token (a string such as ' Paris', or a token id), not {token!r}"[:200])
    ids = list(handle.tokenizer(token, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        raise InputError(f"{name} {token!r} is {len(ids)} tokens {handle.tokens(ids)}; give one token "
                         "(with its leading space where the text puts one) or a token id"[:300])
    return int(ids[0])


class Answer:
    """The answer metric of a target token (and contrast): :meth:`score` of logits ``[..., V]`` is
    ``log P(target)``, or ``z_target − z_contrast`` with a contrast."""

    def __init__(self, handle, target, contrast=None):
        self.target = token_id(handle, target, "target")
        self.contrast = None if contrast is None else token_id(handle, contrast, "contrast")
        if self.contrast == self.target:
            raise InputError("the contrast is the target itself: give another token")
        self.name = "log_prob" if self.contrast is None else "logit_diff"

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.double()
        if self.contrast is None:
            return torch.log_softmax(logits, dim=-1)[..., self.target]
        return logits[..., self.target] - logits[..., self.contrast]

    def direction(self, unembedding: torch.Tensor) -> torch.Tensor:
        """``U_target`` or ``U_target − U_contrast`` (float64 ``[D]``)."""
        u = unembedding[self.target].double()
        return u if self.contrast is None else u - unembedding[self.contrast].double()

    def probabilities(self, logits: torch.Tensor) -> dict:
        """``p_target`` (and ``p_contrast``, ``logit_diff``) of one row of logits ``[V]``."""
        p = torch.softmax(logits.double(), dim=-1)
        out = {"p_target": float(p[self.target])}
        if self.contrast is not None:
            out["p_contrast"] = float(p[self.contrast])
            out["logit_diff"] = float(logits[self.target].double() - logits[self.contrast].double())
        return out


# --------------------------------------------------------------------------------------------
# Direct effects (norms linearised at the run's scale)
# --------------------------------------------------------------------------------------------


def _rms_scale(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, what: str) -> torch.Tensor:
    """The frozen scale ``k`` of an RMS norm at input ``x [D]`` with output ``y [D]``: ``y = x ⊙ k``,
    ``k = g / sqrt(mean(x²) + eps)`` (``g`` read by normalising a vector of ones). Refused in one line
    when the module is not such a norm."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        raise InputError(f"{what} ({type(module).__name__}) is not an RMS norm; direct effects need one")
    ones = torch.ones(1, 1, x.shape[-1], dtype=x.dtype, device=x.device)
    g = module(ones)[0, 0].double() * float(np.sqrt(1.0 + float(eps)))
    k = g / torch.sqrt(x.double().pow(2).mean() + float(eps))
    if not torch.allclose(x.double() * k, y.double(), rtol=1e-3, atol=1e-5 * float(y.double().abs().max()) + 1e-6):
        raise InputError(f"{what} ({type(module).__name__}) is not an RMS norm; direct effects need one")
    return k


def final_norm(model) -> torch.nn.Module:
    """The norm before the unembedding (``model.get_decoder().norm``), refused in one line if absent."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise InputError(f"{type(model).__name__} has no final norm where attngeom looks (get_decoder().norm)")
    return norm


@takes_handle
def direct_effects(handle, ids: Sequence[int], answer: Answer) -> tuple[np.ndarray, dict]:
    """Each head's direct effect on ``answer`` at the last row of ``ids`` (module docstring):
    float64 ``[L, H]``, and ``{"logit": the logit (difference) it decomposes, "heads": Σ of all heads,
    "logits": the last row's logits}``."""
    effects, logit, logits = direct_effects_at(handle, ids, [len(ids) - 1], [answer])
    return effects[0], {"logit": float(logit[0]), "heads": float(effects[0].sum()), "logits": logits[0]}


@takes_handle
@torch.no_grad()
def direct_effects_at(handle, ids: Sequence[int], rows: Sequence[int],
                      answers: Sequence[Answer]) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Direct effects at several rows of one forward of ``ids``, row ``rows[r]`` onto ``answers[r]``:
    float64 ``[R, L, H]``, the logits (differences) they decompose ``[R]`` and the rows' logits ``[R, V]``."""
    model, ad = handle.model, handle.adapter
    L, H = handle.num_layers, handle.num_heads
    rows = [int(r) for r in rows]
    seen: dict = {}
    hooks = []

    def keep_io(key):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            seen[key] = (args[0][0, rows].detach(), y[0, rows].detach())
        return hook

    norm = final_norm(model)
    try:
        for l in range(L):
            hooks.append(ad.o_proj(l).register_forward_pre_hook(
                lambda m, a, l=l: seen.__setitem__(("o", l), a[0][0, rows].detach())))
            delta = ad.attention_delta_module(l)
            if delta is not ad.attention(l):
                hooks.append(delta.register_forward_hook(keep_io(("post", l))))
        hooks.append(norm.register_forward_hook(keep_io("final")))
        out = model(input_ids=torch.tensor([list(ids)], device=handle.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0, rows].float()
    lm_head = model.get_output_embeddings()
    bias = getattr(lm_head, "bias", None)
    x, y = seen["final"]
    effects, logit = np.zeros((len(rows), L, H)), np.zeros(len(rows))
    for r, answer in enumerate(answers):
        k_f = _rms_scale(norm, x[r], y[r], "the final norm")
        u = answer.direction(lm_head.weight.detach()).to(k_f.device)
        ku = k_f * u
        for l in range(L):
            w = ad.w_o_heads(l).double()                                  # [H, d, D]
            o = seen[("o", l)][r].double().reshape(H, -1)                 # [H, d]
            c = torch.einsum("hd,hdD->hD", o.to(w.device), w)             # each head's W_O^h o^h
            if ("post", l) in seen:
                xp, yp = seen[("post", l)]
                c = c * _rms_scale(ad.attention_delta_module(l), xp[r], yp[r],
                                   f"layer {l}'s post-attention norm").to(c.device)
            effects[r, l] = (c @ ku.to(c.device)).cpu().numpy()
        logit[r] = float(y[r].double() @ u.to(y.device))
        if bias is not None:
            logit[r] += float(answer.direction(bias.detach()[:, None])[0])
    return effects, logit, logits


@takes_handle
def answer_direct_effects(handle, ids: Sequence[int], prompt_length: int) -> pd.DataFrame:
    """Each head's direct effect on each generated token's logit at its producing row (one forward of
    prompt + answer ``ids``): ``step``, ``layer``, ``head``, ``direct_effect``; the whole answer
    (``step`` null): the mean over the answer's tokens. Empty where the model's norms are not RMS."""
    from attngeom.errors import UnsupportedArchitectureError

    P, T = int(prompt_length), len(ids)
    if T <= P:
        return pd.DataFrame(columns=["step", "layer", "head", "direct_effect"])
    rows = list(range(P - 1, T - 1))
    try:
        eff, _, _ = direct_effects_at(handle, ids, rows, [Answer(handle, int(ids[q + 1])) for q in rows])
    except (InputError, UnsupportedArchitectureError):
        return pd.DataFrame(columns=["step", "layer", "head", "direct_effect"])
    L, H = eff.shape[1:]
    steps = [*range(len(rows)), None]
    eff = np.concatenate([eff, eff.mean(0, keepdims=True)])
    df = pd.DataFrame({"step": np.repeat(steps, L * H), "layer": np.tile(np.repeat(np.arange(L), H), len(steps)),
                       "head": np.tile(np.arange(H), L * len(steps)), "direct_effect": eff.reshape(-1)})
    df["step"] = pd.array([None if s is None else int(s) for s in df["step"]], dtype="Int64")
    return df


# --------------------------------------------------------------------------------------------
# Total effects (ablation through the capture)
# --------------------------------------------------------------------------------------------


def chunks(items: list, n: int) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


@takes_handle
@torch.no_grad()
def ablated_scores(handle, ids: Sequence[int], heads: Sequence[tuple[int, int]], answer: Answer,
                   ablation: str = "zero", batch_size: int = DEFAULT_BATCH) -> np.ndarray:
    """The answer metric at the last row of ``ids`` with each head of ``heads`` ablated alone (one
    batch row per head, the capture's head removal): float64 ``[len(heads)]``."""
    from attngeom.capture.interventions import HeadMeanRemoval, HeadRemoval
    from attngeom.capture.session import Session
    from attngeom.streaming.passes import forward, make_batches

    removal = {"zero": HeadRemoval, "mean": HeadMeanRemoval}[ablation]
    T, H = len(ids), handle.num_heads
    out = []
    for chunk in chunks(list(heads), batch_size):
        session = Session(intervention=removal(rows=[[lh] for lh in chunk]),
                          block_elements=len(chunk) * H * T * T + 1)
        for batch in make_batches(handle, [list(ids)] * len(chunk), len(chunk)):
            logits = forward(handle, batch, session, logits=True)[:, T - 1]
            out += answer.score(logits).cpu().tolist()
    return np.asarray(out, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Patching head outputs between runs
# --------------------------------------------------------------------------------------------


@takes_handle
@torch.no_grad()
def head_inputs(handle, ids: Sequence[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Each layer's output-projection input (every head's output ``o_i^h``, head ``h`` in columns
    ``h·d .. (h+1)·d``) of a clean forward of ``ids``: ``({layer: [T, H·d]}, logits [T, V])``."""
    ad, seen, hooks = handle.adapter, {}, []
    try:
        for l in range(handle.num_layers):
            hooks.append(ad.o_proj(l).register_forward_pre_hook(
                lambda m, a, l=l: seen.__setitem__(l, a[0][0].detach().clone())))
        out = handle.model(input_ids=torch.tensor([list(ids)], device=handle.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen, out.logits[0].float()


@contextlib.contextmanager
def patching(handle, source: dict[int, torch.Tensor], rows: Sequence[Sequence[tuple[int, int]]],
             positions: Sequence[int]):
    """While active, batch row ``r``'s heads ``rows[r]`` (``(layer, head)`` pairs) take their outputs
    at ``positions`` from ``source`` (:func:`head_inputs` of another run), through a pre-hook on each
    layer's output projection."""
    ad, d = handle.adapter, handle.head_dim
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for r, pairs in enumerate(rows):
        for l, h in pairs:
            by_layer.setdefault(int(l), []).append((r, int(h)))

    def hook_for(l):
        def hook(module, args):
            x = args[0].clone()
            src = source[l].to(x.device, x.dtype)
            for r, h in by_layer[l]:
                cols = slice(h * d, (h + 1) * d)
                x[r, pos.to(x.device), cols] = src[pos.to(src.device), cols]
            return (x, *args[1:])
        return hook

    hooks = [ad.o_proj(l).register_forward_pre_hook(hook_for(l)) for l in by_layer]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@takes_handle
@torch.no_grad()
def patched_logits(handle, ids: Sequence[int], source: dict[int, torch.Tensor],
                   rows: Sequence[Sequence[tuple[int, int]]], positions: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(rows), T, V]`` of ``ids``, batch row ``r`` with heads ``rows[r]`` patched from
    ``source`` at ``positions`` (:func:`patching`)."""
    x = torch.tensor([list(ids)] * len(rows), device=handle.device)
    with patching(handle, source, rows, positions):
        return handle.model(input_ids=x, use_cache=False).logits.float()
