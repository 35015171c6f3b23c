"""Policies scored by KVzip's reconstruction pass (the model repeats its context; kvpress's
``KVzipPress``): KVzip, KVzip+ and KVzip's pass scored by contribution, each with one cut over
all layers and heads (:func:`global_budgets`). The pass itself runs in
:func:`attngeom.kvcache.prefill.reconstruction_scores`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import Policy

if TYPE_CHECKING:  # pragma: no cover
    pass

KVZIP_SINKS = 4
"""Entries at the start of the context KVzip keeps whatever their score (kvpress's ``n_sink``): their score is 1."""


KVZIP_CHUNK = 2048
"""Context tokens repeated per reconstruction pass (kvpress's ``chunk_size``)."""


KVZIP_OVERLAP = 8
"""Tokens of the previous chunk quoted in the request of the next (kvpress's ``prev_postfix_size``)."""


KVZIP_PROMPT = "\n\nRepeat the previous context exactly."
"""The request before the first chunk is repeated (kvpress's, in plain text)."""


KVZIP_PROMPT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
"""The request before every later chunk, followed by the last :data:`KVZIP_OVERLAP` tokens of the chunk before."""


RECONSTRUCTION_SCORES = ("attention", "kvzip_plus", "contribution")
"""What a reconstruction pass scores (``Policy.params["score"]``): attention (KVzip), attention
normalised by ``‖W_O^h v_j‖ / ‖h_i‖`` (KVzip+), or the intra-head contribution ``|c_ij^h|``."""


def global_budgets(contexts: dict, ratio: float, priority) -> dict:
    """One cut over every compressed layer and head together, as kvpress's ``KVzipPress`` makes
    it (``layerwise=False``): of the ``N`` entries of all of them, the ``N − ⌊N·ratio⌋`` with the
    highest ``priority`` (tier, then score; ties: the earlier layer, head and entry) are kept;
    each head's budget is the number of them it holds (a head may keep none). Scores must be
    comparable across heads and layers."""
    import torch

    tiers, scores, shapes = [], [], {}
    for l, ctx in contexts.items():
        if ctx.pos.shape[0] != 1:
            raise ValueError("a global cut is made for one sequence (a prefill of batch 1)")
        ctx.budget = ctx.valid.sum(-1).max(0).values
        tier, score = priority(ctx)
        tiers.append(torch.where(ctx.valid, tier.long(), -1)[0].reshape(-1).cpu())
        scores.append(torch.nan_to_num(score.float(), nan=float("-inf")).masked_fill(~ctx.valid, float("-inf"))[0].reshape(-1).cpu())
        shapes[l] = ctx.pos.shape[1:]
    tier, score = torch.cat(tiers), torch.cat(scores)
    total = int(sum(int(c.valid.sum()) for c in contexts.values()))
    keep = total - int(total * ratio)
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.sort(tier[order], descending=True, stable=True).indices]
    won = torch.zeros(score.numel(), dtype=torch.long)
    won[order[:keep]] = 1
    out, start = {}, 0
    for l, (h, n) in shapes.items():
        out[l] = won[start : start + h * n].reshape(h, n).sum(-1)
        start += h * n
    return out


def _reconstruction(name: str, doc: str, score: str, geometry: bool = False) -> Policy:
    """A policy scored by KVzip's reconstruction pass (:func:`attngeom.kvcache.prefill.reconstruction_scores`):
    the largest ``score`` any query of the pass gives an entry, the maximum also over the query
    heads of a key/value head, the first :data:`KVZIP_SINKS` entries scored 1, one global cut
    (:func:`global_budgets`)."""
    import torch

    def priority(ctx):
        return torch.zeros_like(ctx.pos), ctx.score

    return Policy(name, doc, priority, needs="reconstruction", accumulate=False, pool="max", prefill_only=True,
                  params={"score": score, "sinks": KVZIP_SINKS, "chunk": KVZIP_CHUNK}, geometry=geometry,
                  allocator=lambda cs, r: global_budgets(cs, r, priority))


def kvzip() -> Policy:
    """KVzip (Kim et al., *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*,
    NeurIPS 2025), as kvpress's ``KVzipPress`` by default: after the prefill the model is asked to
    repeat its context, chunk by chunk (:data:`KVZIP_PROMPT`, the chat template's assistant turn,
    then the chunk's own tokens, read with the full cache); an entry's score is the largest
    attention any query of its chunk's pass pays it (the softmax over the sinks, the chunk and the
    pass's own tokens, as kvpress computes it), the maximum also over the query heads of a
    key/value head; the first :data:`KVZIP_SINKS` entries score 1; one cut over all layers and
    heads (:func:`global_budgets`). Costs one more forward pass over the whole context."""
    return _reconstruction("kvzip", "max attention while the model repeats its context, one global cut", "attention")


def kvzip_plus() -> Policy:
    """KVzip+ (kvpress's ``KVzipPress(kvzip_plus_normalization=True)``; Kim et al., KVzip, and its
    maintainers' normalisation): KVzip with each attention weight ``a_ij^h`` of the reconstruction
    pass multiplied by ``‖W_O^h v_j‖₂ / ‖h_i‖₂`` (``h_i`` the attention's input at the query: what
    the entry adds to the residual stream, relative to the stream), then the maximum; one global cut."""
    return _reconstruction("kvzip_plus", "KVzip's max of a_ij |W_O v_j| / |h_i|, one global cut", "kvzip_plus")


def kvzip_contribution() -> Policy:
    """KVzip's reconstruction pass scored by contribution (this toolkit; SPEC §2): the pass of
    :func:`kvzip` (chunks, sinks, its renormalised attention), each entry scored by the largest
    ``|c_ij^h| = |⟨ã_ij^h W_O^h v_j, õ_i^h⟩| / ‖õ_i^h‖²`` any query of the pass gives it (``õ_i^h``
    the head output over the entries the pass attends to), one global cut over all layers and
    heads. A contribution is a share of the head's output, comparable across heads and layers
    as attention is."""
    return _reconstruction("kvzip_contribution", "KVzip's pass scored by max |contribution|, one global cut",
                           "contribution", geometry=True)
