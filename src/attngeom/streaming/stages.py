"""Runner stages of reducers: :func:`reduce_stage` streams items through reducers as one resumable
stage of a run and merges the records; :func:`summaries` is the per-head and per-token stage of
``attngeom analyze`` (SPEC §2).

What belongs here: reducers as stages of :class:`attngeom.runs.run.Run`. Not here: the forward pass
and streaming themselves (:mod:`attngeom.streaming.passes`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import ModelHandleLike, RunLike
from attngeom.streaming.passes import stream, to_ids
from attngeom.streaming.reducers import Reducer



@takes_handle
def reduce_stage(handle: ModelHandleLike, run: RunLike, name: str, items: Sequence,
                 make: Callable[[], Sequence[Reducer]], *, layers: Iterable[int] | None = None, batch_size: int = 1,
                 desc: str | None = None, each: bool = False, route: str = "auto"):
    """Stream ``items`` through fresh reducers ``make()`` as stage ``name`` of ``run`` (an
    :class:`attngeom.runs.run.Run`: one record of reducer states per group of items, resumable and
    shareable among processes; None: in memory), then return ``make()`` loaded with the merged
    states of every record: the reducers as if one pass had seen every item. Each item keeps its
    index in ``items`` as ``batch.index``. ``each=True`` returns ``(reducers, per_item)`` with
    ``per_item`` one ``make()`` per item loaded with its record's state, in item order (None when
    a record covers several items: ``batch_size > 1``). ``route``: the capture's (SPEC §10)."""
    from attngeom.runs.run import fingerprint, merge_sums, run_or_in_memory

    ids = [to_ids(handle, x) for x in items]

    def work(units: list[int]) -> dict:
        reducers = make()
        stream(handle, [ids[u] for u in units], reducers, layers=layers, batch_size=batch_size, progress=False,
               index=units, route=route)
        return {str(k): r.state() for k, r in enumerate(reducers)}

    records = run_or_in_memory(run).stage(name, len(ids), work, group=batch_size, desc=desc or name, unit="window",
                                      fingerprints=[fingerprint(x) for x in ids])
    merged = merge_sums(records.values())
    reducers = [r.load_state(merged[str(k)]) for k, r in enumerate(make())]
    if not each:
        return reducers
    from attngeom.runs.contract import window_records

    recs = window_records(records)
    if recs is None:
        return reducers, None
    loaded = []
    for rec in recs:
        state = merge_sums([rec])                          # the merged records' form, one record
        loaded.append([r.load_state(state[str(k)]) for k, r in enumerate(make())])
    return reducers, loaded


@takes_handle
def summaries(handle: ModelHandleLike, run: RunLike, items: Sequence, *, layers: Iterable[int] | None = None,
              sink: int = 0, batch_size: int = 1, stage: str = "summaries", each: bool = False,
              route: str = "auto"):
    """Per-head (:class:`~attngeom.streaming.reducers.HeadStats`) and per-token
    (:class:`~attngeom.streaming.reducers.TokenStats`) summaries of ``items`` as one stage of ``run``
    (:func:`reduce_stage`). Returns ``(heads, tokens)`` DataFrames; ``tokens.text`` is the item's index.
    ``each=True`` adds a third: each item's own ``heads`` table, in item order (None when
    ``batch_size > 1``: a record then covers several items). ``route``: the capture's (SPEC §10);
    ``heads.route`` records the route each layer took (:class:`~attngeom.streaming.reducers.RouteRecord`)."""
    from attngeom.streaming.reducers import HeadStats, RouteRecord, TokenStats

    out = reduce_stage(handle, run, stage, items,
                       lambda: [HeadStats(sink=sink), TokenStats(sink=sink), RouteRecord()],
                       layers=layers, batch_size=batch_size, desc="analyse", each=each, route=route)
    (hs, ts, routes), per_item = out if each else (out, None)
    heads = hs.result()
    heads["route"] = heads["layer"].map(routes.result())
    if not each:
        return heads, ts.result()
    return heads, ts.result(), None if per_item is None else [h.result() for h, _, _ in per_item]
