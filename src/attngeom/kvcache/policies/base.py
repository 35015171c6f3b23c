"""What every KV-cache policy is made of: :class:`Policy` (one small class per method, its
scores from what a block offers, its ranking and its budget rule) and :class:`EvictionContext`
(what a policy sees when a head is cut). The policies themselves live one family per module of
:mod:`attngeom.kvcache.policies`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass
from typing import Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

SINKS = 4
"""Protected attention-sink entries of StreamingLLM (its paper keeps 4 initial tokens)."""


RECENT = 0.5
"""Share of a head's budget kept as the recent window by H2O-style policies (H2O's equal split of
heavy hitters and recent tokens); the same split is used for VATP and the contribution policies
so that they differ from H2O only in the score."""


@dataclass
class EvictionContext:
    """What a policy sees at an eviction, per key/value head: ``pos [B, Hkv, n]`` absolute
    positions of the entries, ``valid [B, Hkv, n]`` bool (False: padding of a head with a smaller
    budget), ``score [B, Hkv, n]`` the recorded scores pooled over the query heads of each group,
    ``values [B, Hkv, n, d]``, ``seen`` tokens read so far, ``budget [Hkv]`` each head's budget."""

    pos: torch.Tensor
    valid: torch.Tensor
    score: torch.Tensor
    values: torch.Tensor
    seen: int
    budget: torch.Tensor
    streaming: torch.Tensor | None = None  # [Hkv] bool: heads given sink + window only (taxonomy)
    keys: torch.Tensor | None = None       # [B, Hkv, n, d] cached (RoPE-rotated) keys
    layer: int = -1                        # the cache layer
    num_heads: int = 0                     # query heads H
    w_o: torch.Tensor | None = None        # [D, H*d] the layer's output projection (float32), when recorded
    value_l1: torch.Tensor | None = None   # [B, Hkv, n] projected_value_l1 of these values, once computed

    def recent(self, count: torch.Tensor | int) -> torch.Tensor:
        """``[B, Hkv, n]`` bool: the entry is among the last ``count`` positions (per head)."""
        import torch

        count = torch.as_tensor(count, device=self.pos.device).reshape(1, -1, 1)
        return self.pos >= self.seen - count

    def sinks(self, count: int) -> torch.Tensor:
        return self.pos < count


POLICY_OPTIONS = ("needs", "accumulate", "pool", "last", "signed", "per_head_budgets", "prefill_only", "geometry")
"""What a policy may set besides its name, its ranking and its budget rule (class attributes of :class:`Policy`)."""


class Policy:
    """One eviction policy: its scores, its ranking and its budget rule (module docstring).

    A policy is a small class (kvpress's presses are): subclass it, give it a ``name``, say what
    :meth:`step` reads from a block (``needs``: ``"attention"``, ``"contribution"``, or your own
    word when you override :meth:`step`), and rank the entries in :meth:`priority`; override
    :meth:`allocate` for budgets other than the same ``n − ⌊n·ratio⌋`` in every head::

        class LastQueries(Policy):
            name, needs, last, accumulate = "last16", "attention", 16, False
            def priority(self, ctx):
                return ctx.sinks(4).long(), ctx.score

    ``attngeom kvtasks --policies mymodule:LastQueries`` and
    :func:`~attngeom.kvcache.generate.compressed_generate` take it as it is (:func:`~attngeom.kvcache.policies.get_policy`).
    The toolkit's own policies are instances of this class made by the factories of
    :data:`~attngeom.kvcache.policies.POLICIES` (``Policy(name, doc, priority, allocator=..., params=..., **options)``).

    Attributes: ``needs`` None (no scores: plain SDPA), ``"attention"``, ``"contribution"``,
    ``"leave_one_out[_head]"`` or ``"reconstruction"`` (KVzip's pass); ``last``: :meth:`step`
    reads only the last ``last`` queries of the forward pass (None: all); ``accumulate``: scores
    summed over forward passes (H2O) or replaced by the latest (SnapKV); ``pool``: query heads of a
    key/value head pooled by ``"mean"``, ``"max"`` or ``"layer"``; ``signed``: contributions with
    their sign; ``per_head_budgets``: budgets from a head taxonomy; ``prefill_only``: defined only
    for compression once after a prefill; ``geometry``: derived from the papers' geometry."""

    name: str = ""
    doc: str = ""
    needs: str | None = None
    accumulate: bool = True
    pool: str = "mean"
    last: int | None = None
    signed: bool = False
    per_head_budgets: bool = False
    prefill_only: bool = False
    geometry: bool = False
    allocator: Callable[[dict, float], dict] | None = None

    def __init__(self, name: str | None = None, doc: str | None = None,
                 priority: Callable[[EvictionContext], tuple] | None = None, *,
                 allocator: Callable[[dict, float], dict] | None = None, params: dict | None = None, **options):
        if name is not None:
            self.name = name
        if doc is not None:
            self.doc = doc
        elif not self.doc:
            self.doc = (type(self).__doc__ or "").strip().split("\n")[0]
        if priority is not None:
            self._priority = priority
        if allocator is not None:
            self.allocator = allocator
        self.params = dict(params or {})
        for key, value in options.items():
            if key not in POLICY_OPTIONS:
                raise TypeError(f"unknown policy option {key!r}; a policy sets {', '.join(POLICY_OPTIONS)}")
            setattr(self, key, value)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{type(self).__name__}: a policy needs a name (a non-empty string)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def priority(self, ctx: EvictionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, score)``, both ``[B, Hkv, n]``: each head keeps its entries of highest tier first,
        then of highest score (ties: the earlier entry)."""
        fn = getattr(self, "_priority", None)
        if fn is None:
            raise NotImplementedError(f"{type(self).__name__} ranks no entries: define priority(self, ctx)")
        return fn(ctx)

    def allocate(self, contexts: dict[int, EvictionContext], ratio: float) -> dict:
        """Entries each key/value head keeps at compression ratio ``ratio``, per layer:
        ``{layer: [Hkv] long}``. Default: ``n − ⌊n·ratio⌋`` in every head (kvpress's rule);
        ``allocator`` (PyramidKV's layers, AdaKV's heads, KVzip's global cut) shares the same total otherwise."""
        if self.allocator is not None:
            return self.allocator(contexts, ratio)
        return {l: uniform_keep(ctx, ratio) for l, ctx in contexts.items()}

    def step(self, block, n_queries: int) -> torch.Tensor | None:
        """``[B, H, S]``: this block's scores summed over the queries the policy reads
        (block query ``i`` is query ``q_start + i`` of a forward pass of ``n_queries`` queries)."""
        if self.needs is None or self.needs == "reconstruction":  # reconstruction: recorded by its own pass
            return None
        first = 0 if self.last is None else max(0, max(0, n_queries - self.last) - block.q_start)
        if first >= block.a.shape[2]:
            return None
        if self.needs == "contribution":
            m = block.contribution[:, :, first:]
            m = m if self.signed else m.abs()
        elif self.needs in ("leave_one_out", "leave_one_out_head"):
            from attngeom.metrics.leave_one_out import leave_one_out

            m = leave_one_out(block, head_space=self.needs == "leave_one_out_head", first=first) ** 2
        elif self.needs == "attention":
            m = block.a[:, :, first:]
        else:
            raise NotImplementedError(f"{type(self).__name__} needs {self.needs!r}: define step(self, block, n_queries)")
        return m.sum(2)


def uniform_keep(ctx: EvictionContext, ratio: float) -> "torch.Tensor":
    """``[Hkv]``: ``n − ⌊n·ratio⌋`` entries in every key/value head (kvpress's rule)."""
    import torch

    n = int(ctx.valid.sum(-1).max())
    return torch.full((ctx.valid.shape[1],), n - int(n * ratio), dtype=torch.long)


def _tiers(*levels: torch.Tensor) -> torch.Tensor:
    """Tier per entry: the number of protections it has (``levels`` bool maps)."""
    import torch

    out = torch.zeros_like(levels[0], dtype=torch.int64)
    for lv in levels:
        out = out + lv.long()
    return out


def _recent_count(ctx: EvictionContext, share: float) -> torch.Tensor:
    return (ctx.budget.float() * share).long()
