"""A compressed ``generate`` (docs/kvcache.md): the field's protocol for one context, what a user
imports (``from attngeom.kvcache import compressed_generate``). The context is read and its cache
compressed once by a policy (:mod:`attngeom.kvcache.policies`, or a class of your own) at a
compression ratio; the question and the answer follow with transformers' ``generate`` over the
compressed cache (:mod:`attngeom.kvcache.cache`). The benchmark over RULER's tasks is
:mod:`attngeom.kvcache.tasks`; nothing here depends on it."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from attngeom.errors import InputError
from attngeom.kvcache import prefill as P
from attngeom.kvcache.cache import check_memory
from attngeom.kvcache.policies import get_policy
from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import ModelHandleLike


@takes_handle
@torch.no_grad()
def compressed_generate(handle: ModelHandleLike, context: Sequence[int], question: Sequence[int], policy: str,
                        ratio: float, **generate_kwargs) -> torch.Tensor:
    """``model.generate`` after the field's protocol: ``context`` (token ids) read and its cache
    compressed once by ``policy`` at ``ratio``, then ``question`` (not compressed) and the answer
    decoded by ``generate`` with ``generate_kwargs``. Returns ``generate``'s ids ``[1, T]``
    (context, question and answer). With ``ratio=0`` the answer is the full cache's. Refused in one
    line before any compute: an empty context, an id beyond the vocabulary, a ``max_new_tokens`` that
    is not a count or would run past the model's context."""
    from attngeom.model.arguments import check_count, check_positions, whole_number
    from attngeom.streaming.passes import check_ids

    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.number)) or not 0.0 <= float(ratio) < 1.0:
        raise InputError(f"ratio is the share of the cache removed, in [0, 1); got {ratio!r}"[:200])
    pol = get_policy(policy)
    if pol.name == "taxonomy":
        raise InputError("the taxonomy policy's budgets need a head taxonomy; use attngeom kvcache")
    for what, ids in (("context", context), ("question", question)):
        if isinstance(ids, (str, bytes)):
            raise InputError(f"the {what} is text; compressed_generate takes token ids: "
                             f"handle.tokenizer.encode(text, add_special_tokens=False)")
    context, question = ([whole_number(i, "a token id") for i in ids] for ids in (context, question))
    if not context:
        raise InputError("the context is empty: compressed_generate compresses the cache of at least one token")
    check_ids(handle, context + question)
    new = generate_kwargs.get("max_new_tokens")
    new = 0 if new is None else check_count(new, "max_new_tokens")
    total = len(context) + len(question) + new
    check_positions(handle, total, f"compressed_generate (context {len(context)} + question {len(question)} + "
                                   f"max_new_tokens {new})")
    check_memory(handle, total, 1)
    pre = P.prefill(handle, context, [pol])
    cache = P.variant_cache(handle, pre, [P.selection_at_ratio(pre, pol, float(ratio), handle.num_heads)],
                            room=len(question) + new)
    ids = torch.as_tensor([context + question], device=handle.device)
    with P.compressing(handle.model, cache):
        return handle.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                     **generate_kwargs)
