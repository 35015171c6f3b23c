"""The single-text analysis (``attngeom analyze``) as an experiment: one text, or a prompt and the
model's own answer (SPEC §7), reduced to per-token and per-head tables and a summary (the metrics of
SPEC §2).

:func:`experiment` analyses one text (or token ids): one streaming pass of
:class:`~attngeom.streaming.reducers.HeadStats` and :class:`~attngeom.streaming.reducers.TokenStats` over the text, cut
into windows when it is longer than the context (:func:`cut_windows`); with a
:class:`~attngeom.generation.decoding.Decoding` in the settings the text is a prompt, the answer is generated
with :class:`~attngeom.generation.answers.AnswerSources` observing every step and the summaries see prompt +
answer as a text. :func:`answer_experiment` answers many prompts (corpus mode). Both return an
:class:`~attngeom.runs.contract.ExperimentResult` (name ``"analyze"``)::

    from attngeom import load_model
    from attngeom.analysis.experiment import experiment
    from attngeom.runs.run import InMemoryRun
    from attngeom.analysis.settings import AnalyzeSettings

    res = experiment(load_model("smollm2-135m"), InMemoryRun(), "The cat sat.", AnalyzeSettings(layers=(0, 15)))
    res.tables["tokens"], res.tables["heads"], res.summary["per_layer"]

**Windows** (``window``, ``stride``): the input's tokens (BOS excluded) are cut into windows of
``window - 1`` tokens starting every ``stride`` tokens (default ``window - 1``: no overlap), each
window gets the BOS token (the sink) in front and is analysed as a text of its own; the last window
ends at the last token (it may be shorter). ``tokens`` then has one row per (window, layer,
position), with ``text`` = the window's index and ``input_position`` = the token's position in the
whole input (BOS = 0); ``heads`` averages over the queries of all windows; maps show the first window.

What belongs here: the analysis logic behind the ``analyze`` command (its tables, the numbers of its
summary: per-layer sink aggregates, the top tokens by what they receive, the generation summary;
which input window its maps show), on the tables of :func:`attngeom.streaming.stages.summaries`
(``HeadStats`` rows per layer and head, ``TokenStats`` rows per text, layer and position) and of
:mod:`attngeom.generation.decoding`. Not here: the forward passes (:mod:`attngeom.streaming.passes`,
:mod:`attngeom.streaming.stages`), the decoding loop (:mod:`attngeom.generation.decoding`), the maps and figures
(:func:`attngeom.traces.trace.analyze`, :mod:`attngeom.reports.analyze`, drawn by the command's write
step) and the command (:mod:`attngeom.commands.analyze`: it parses, runs and writes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attngeom.model.arguments import takes_handle
from attngeom.errors import InputError
from attngeom.analysis.settings import AnalyzeSettings

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike
    from attngeom.generation.decoding import Decoding

TOP_K = 5
"""Tokens listed per ranking."""
MIN_SEEN_BY = 8
"""The top-k rankings leave out the sources seen by fewer than ``max(8, T/4)`` queries (at most
``T/2``; :func:`top_tokens`): a late token's 'received' mean averages over a few nearby queries
only, which mostly attend locally, and would fill the ranking with the last positions."""


def cut_windows(ids: list[int], window: int, stride: int | None,
                bos: int | None) -> tuple[list[tuple[int, list[int]]], bool]:
    """Windows covering every token of ``ids`` (:func:`attngeom.data.corpora.windows` with ``keep_last``)
    and whether they start with BOS: ``([(offset, window_ids), ...], has_bos)``; window position
    ``p`` is input position ``offset + p`` (the BOS of a window is input position 0)."""
    from attngeom.data.corpora import windows as cut

    has_bos = bool(bos is not None and ids and ids[0] == bos)
    body = ids[1:] if has_bos else list(ids)
    step = stride or (window - 1 if has_bos else window)
    wins = cut(body, window, step, bos=bos if has_bos else None, keep_last=True)
    return [(k * step, w) for k, w in enumerate(wins)], has_bos


def add_input_positions(tokens: "pd.DataFrame", windows: Sequence[tuple[int, list[int]]], has_bos: bool) -> None:
    """Insert ``input_position`` after ``position`` in a ``TokenStats`` table of the windows of
    :func:`cut_windows`: the token's position in the whole input (``offset + position``; a window's
    repeated BOS is input position 0)."""
    offsets = {i: off for i, (off, _) in enumerate(windows)}
    pos = tokens["position"].to_numpy()
    off = tokens["text"].map(offsets).to_numpy()
    tokens.insert(tokens.columns.get_loc("position") + 1, "input_position",
                  ((pos + off) * (pos > 0)) if has_bos else (pos + off))


def per_layer_sinks(heads: "pd.DataFrame") -> list[dict]:
    """Per layer: the sink's attention and intra-head contribution (mean, min and max over heads of
    the per-head means over queries ``i > 0``) and its share of the layer output (the sum over heads
    of the inter-head contribution ``C_i0^h``), from the ``HeadStats`` table."""
    out = []
    for layer, g in heads.groupby("layer", sort=True):
        out.append({
            "layer": int(layer),
            "sink_attention": float(g["sink_rate"].mean()),
            "sink_attention_min": float(g["sink_rate"].min()),
            "sink_attention_max": float(g["sink_rate"].max()),
            "sink_contribution": float(g["sink_contribution"].mean()),
            "sink_contribution_min": float(g["sink_contribution"].min()),
            "sink_contribution_max": float(g["sink_contribution"].max()),
            "sink_contribution_to_layer_output": float(g["sink_contribution_inter"].sum()),
        })
    return out


def top_tokens(tokens: "pd.DataFrame", window_lengths: Sequence[int], layer: int, *, top_k: int = TOP_K,
               min_seen_by: int = MIN_SEEN_BY,
               columns: Sequence[str] = ("contribution_received", "attention_received")) -> dict:
    """The ``top_k`` tokens of ``layer`` by each of ``columns`` (what a source receives, averaged over
    the queries that see it), from the ``TokenStats`` table with ``input_position`` and ``token``
    columns. Only positions seen by at least ``max(1, min(min_seen_by, span // 2), span // 4)``
    queries are ranked (``span``: the most queries any position is seen by); ties keep the table's
    order. With several windows each row names its ``window``."""
    t = tokens[tokens["layer"] == layer].copy()
    lengths = dict(enumerate(window_lengths))
    t["seen_by"] = t["text"].map(lengths) - t["position"]
    span = int(t["seen_by"].max()) if len(t) else 1
    need = max(1, min(min_seen_by, span // 2), span // 4)
    t = t[t["seen_by"] >= need]

    def top(col):
        rows = t.sort_values(col, ascending=False, kind="stable").head(top_k)
        return [{"position": int(r.input_position), "token": r.token, "score": float(r[col]),
                 **({"window": int(r.text)} if len(window_lengths) > 1 else {})}
                for _, r in rows.iterrows()]

    return {"layer": int(layer), "ranked_over": f"positions seen by at least {need} queries",
            "min_seen_by": int(need), **{f"by_{c}": top(c) for c in columns}}


def summarize(heads: "pd.DataFrame", tokens: "pd.DataFrame", window_lengths: Sequence[int],
              layers: Sequence[int]) -> dict:
    """The analysis numbers of a text's summary: ``per_layer`` (:func:`per_layer_sinks`), their means
    over layers, and ``top_tokens`` (:func:`top_tokens`) at the middle analysed layer."""
    import numpy as np

    per_layer = per_layer_sinks(heads)
    mid = layers[len(layers) // 2]
    return {"per_layer": per_layer,
            "mean_sink_attention": float(np.mean([r["sink_attention"] for r in per_layer])),
            "mean_sink_contribution": float(np.mean([r["sink_contribution"] for r in per_layer])),
            "top_tokens": top_tokens(tokens, window_lengths, mid)}


DEFINITIONS = {
    "sink_attention": "mean over heads of the per-head mean over queries i>0 of a_i0^h",
    "sink_contribution": "mean over heads of the per-head mean over queries i>0 of c_i0^h (intra-head)",
    "sink_contribution_to_layer_output": "sum over heads of the mean over queries i>0 of C_i0^h "
                                         "(the sink's share of the layer output o_i)",
    "*_received": "token-level score of SPEC §2 a source receives, averaged over the queries that see it",
}
"""summary.json's ``definitions``: what the per-layer numbers are."""


# --------------------------------------------------------------------------------------------
# The experiment: one text (or a prompt and its answer)
# --------------------------------------------------------------------------------------------


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, text_or_ids, settings: AnalyzeSettings = AnalyzeSettings(),
               *, source: str | None = None) -> ExperimentResult:
    """The single-text analysis of ``text_or_ids`` (a text, token ids, or with ``settings.decoding``
    a prompt: text, ids or chat messages) with ``settings``
    (:class:`~attngeom.analysis.settings.AnalyzeSettings`), as stage ``summaries`` of ``run`` (one record per
    window), or stage ``generate`` with a decoding (one record); ``source`` names the input in the
    summary. Bad input (unknown layers or heads, too long without windows, too short, the sink
    beyond it) raises :class:`~attngeom.errors.InputError` before any forward pass.

    Returns an :class:`~attngeom.runs.contract.ExperimentResult`: tables ``tokens`` (one row per
    window, layer and position, with ``input_position``, ``token`` and, generating, ``generated``)
    and ``heads`` (per layer and head, over the queries of every window), with a decoding also
    ``answer_shares``, ``answer_sources`` and ``answer_summary``; the ``summary`` of summary.json
    (model, input, per-layer sinks, top tokens, generation, maps; the command adds ``runtime_s`` and
    ``files`` and records its run's settings); ``per_window`` (window order): ``offset`` (window
    position ``p`` is input position ``offset + p``, BOS aside), ``ids`` and, per window and analysed layer
    (columns in ``summary["layers"]`` order), the additive sums over its queries ``i > 0`` that
    ``summary["per_layer"]`` is the ratio of (:func:`window_sums`)."""
    from attngeom.runs.contract import ExperimentResult
    from attngeom.streaming.passes import to_ids
    from attngeom.streaming.stages import summaries

    if settings.decoding is not None and settings.window is not None:
        raise InputError("windows do not apply to a generation: the prompt and its answer are analysed whole")
    layers = analysed_layers(handle, settings.layers)
    fig_layers = figure_layers(handle, settings.figure_layers, layers)
    check_heads(handle, settings.heads)
    answer = None
    if settings.decoding is not None:
        answer = generate_answer(handle, run, text_or_ids, settings, layers)
        ids = answer["ids"]
    else:
        ids = to_ids(handle, text_or_ids)
    windows, has_bos = input_windows(handle, ids, settings.window, settings.stride, settings.sink)
    if answer is not None:
        heads_df, tokens_df, each = answer["heads"], answer["tokens"], [answer["heads"]]
    else:
        heads_df, tokens_df, each = summaries(handle, run, [w for _, w in windows], layers=layers,
                                              sink=settings.sink, each=True, route=settings.route)
    with_token_strings(handle, {"tokens": tokens_df}, ids)
    add_input_positions(tokens_df, windows, has_bos)
    summary = build_summary(handle, settings, source, ids, windows, layers, fig_layers, heads_df, tokens_df)
    tables = {"tokens": tokens_df, "heads": heads_df}
    if answer is not None:
        tokens_df["generated"] = tokens_df["position"] >= answer["prompt_length"]
        summary["generation"] = generation_summary(handle, answer, settings.decoding, settings.sink,
                                                   settings.rank_special)
        tables.update({f"answer_{k}": v for k, v in answer["tables"].items()})
    per_window = {"offset": [off for off, _ in windows], "ids": [w for _, w in windows], **window_sums(each, layers)}
    res = ExperimentResult("analyze", tables=tables, summary=summary, per_window=per_window,
                           settings=settings.record())
    first = windows[0][1]
    summary["maps"] = (f"drawn for layers {fig_layers}" if map_window(res) is not None else
                       f"maps not drawn: the input window has {len(first)} tokens, more than --max-map-tokens "
                       f"{settings.max_map_tokens}" if fig_layers else "no figure layers")
    return res


def map_window(result: ExperimentResult) -> list[int] | None:
    """The ids whose maps the report draws at ``summary["figure_layers"]`` (the first window of an
    :func:`experiment`'s result), or None: no figure layers, or the window is longer than
    ``max_map_tokens``."""
    first = result.per_window["ids"][0]
    return first if result.summary["figure_layers"] and len(first) <= result.settings["max_map_tokens"] else None


@takes_handle
def figure_maps(handle: ModelHandleLike, result: ExperimentResult):
    """The maps the figures draw, one figure layer at a time: ``(layer trace, tokens)`` of a full
    trace (:func:`attngeom.traces.trace.analyze`) of :func:`map_window` at ``summary["figure_layers"]``
    (nothing when no map is drawn). A layer's maps are freed once the next layer is asked for."""
    first = map_window(result)
    if first is None:
        return
    from attngeom.traces.trace import analyze

    trace = analyze(handle, first, layers=result.summary["figure_layers"])
    for number in trace.layers.numbers:
        yield trace.layers.pop(number), trace.tokens


@takes_handle
def analysed_layers(handle: ModelHandleLike, layers) -> list[int]:
    """The analysed layers, sorted (None: all), each checked against the model."""
    from attngeom.data.corpora import check_layers

    return sorted(set(check_layers(layers, handle.num_layers) or range(handle.num_layers)))


@takes_handle
def figure_layers(handle: ModelHandleLike, given, layers: list[int]) -> list[int]:
    """The layers drawn as maps: ``given`` (checked, sorted), or the first, a middle and the last
    analysed layer."""
    from attngeom.data.corpora import check_layers

    if given is not None:
        return sorted(set(check_layers(given, handle.num_layers)))
    if len(layers) <= 3:
        return list(layers)
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


@takes_handle
def check_heads(handle: ModelHandleLike, heads) -> None:
    bad = [h for h in heads or () if not 0 <= h < handle.num_heads]
    if bad:
        raise InputError(f"head {bad[0]} does not exist: the model has heads 0..{handle.num_heads - 1}")


@takes_handle
def input_windows(handle: ModelHandleLike, ids: list[int], window: int | None, stride: int | None,
                  sink: int) -> tuple[list[tuple[int, list[int]]], bool]:
    """The input as windows (:func:`cut_windows` with ``window``; else one), checked: an input
    longer than the context needs windows, each window needs 2 tokens and the sink inside."""
    limit = handle.max_positions
    if window is not None:
        if limit and window > limit:
            raise InputError(f"--window {window} is longer than the model's context ({limit} tokens)")
        windows, has_bos = cut_windows(ids, window, stride, handle.tokenizer.bos_token_id)
    else:
        if limit and len(ids) > limit:
            raise InputError(
                f"the input has {len(ids)} tokens but {handle.name} handles at most {limit}; "
                f"analyse it in windows with --window {limit} (and optionally --stride)")
        windows, has_bos = [(0, ids)], False
    if not windows or min(len(w) for _, w in windows) < 2:
        raise InputError(f"the input has {len(ids)} token(s) after encoding; give a text of at least 2 tokens "
                         "(a single token has no source to attend to but itself)")
    if sink >= min(len(w) for _, w in windows):
        raise InputError(f"--sink {sink} is beyond the input ({min(len(w) for _, w in windows)} tokens)")
    return windows, has_bos


def window_sums(heads: Sequence["pd.DataFrame"], layers: Sequence[int]) -> dict:
    """Per window (one ``HeadStats`` table each) and layer, ``[windows, layers]`` arrays: the
    ``queries`` ``i > 0``, and ``sink_attention``, ``sink_contribution`` and
    ``sink_contribution_to_layer_output`` of :func:`per_layer_sinks` times ``queries`` (sums over
    the window's queries): their column sums divided by ``queries``' are :func:`per_layer_sinks` of
    the whole input."""
    import numpy as np

    keys = ("sink_attention", "sink_contribution", "sink_contribution_to_layer_output")
    out = {k: np.zeros((len(heads), len(layers))) for k in ("queries", *keys)}
    for w, table in enumerate(heads):
        rows = {r["layer"]: r for r in per_layer_sinks(table)}
        queries = table.groupby("layer")["queries"].first()
        for j, layer in enumerate(layers):
            out["queries"][w, j] = n = float(queries[layer])
            for k in keys:
                out[k][w, j] = rows[layer][k] * n
    return out


@takes_handle
def build_summary(handle: ModelHandleLike, settings: AnalyzeSettings, source: str | None, ids: list[int],
                  windows, layers: list[int], fig_layers: list[int], heads_df, tokens_df) -> dict:
    """summary.json of one text, before ``generation``, ``maps``, ``runtime_s`` and ``files``."""
    from attngeom.runs.run import versions

    return {
        "command": "analyze",
        "attngeom_version": versions()["attngeom"],
        "model": {"name": handle.name, "spec": getattr(handle, "spec", handle.name),
                  "architecture": handle.architecture,
                  "layers": handle.num_layers, "heads": handle.num_heads, "kv_heads": handle.num_kv_heads,
                  # attention layer l is decoder layer decoder_layers[l] (they differ in hybrid models)
                  "decoder_layers": getattr(getattr(handle, "adapter", None), "decoder_index", None),
                  "head_dim": handle.head_dim, "dtype": str(handle.dtype).removeprefix("torch."),
                  "device": str(handle.device), "max_positions": handle.max_positions},
        "input": {"source": source, "tokens": len(ids),
                  "windows": len(windows), "window": settings.window,
                  "stride": settings.stride if settings.window else None,
                  "window_lengths": [len(w) for _, w in windows][:50]},
        "T": len(ids),
        "sink": settings.sink,
        "layers": layers,
        "figure_layers": fig_layers,
        **summarize(heads_df, tokens_df, [len(w) for _, w in windows], layers),
        "definitions": dict(DEFINITIONS),
        "settings": settings.record(),
    }


@takes_handle
def with_token_strings(handle: ModelHandleLike, tables: dict, ids) -> dict:
    """Each table's ``token_id``/``source_id`` column followed by the token's string."""
    ids = sorted(set(ids))
    strings = dict(zip(ids, handle.tokens(ids)))
    for df in tables.values():
        for col, name in (("token_id", "token"), ("source_id", "source_token")):
            if col in df:
                df.insert(df.columns.get_loc(col) + 1, name, df[col].map(strings))
    return tables


# --------------------------------------------------------------------------------------------
# The model's own answer
# --------------------------------------------------------------------------------------------


@takes_handle
def generate_answer(handle: ModelHandleLike, run: RunLike, prompt, settings: AnalyzeSettings,
                    layers: list[int]) -> dict:
    """Generate the answer with the answer tables observing every step and the per-head and
    per-token summaries seeing prompt + answer as a text (text reducers of
    :func:`attngeom.generation.decoding.stream_generation`: the same rows, one call for the answer instead of one per
    token), as stage ``generate`` of the run (one record, resumable). Returns the prompt + answer
    ids, the summaries and the answer tables (with token strings and the marks of
    :func:`attngeom.generation.heads.token_marks`), and which chat template was used (None: no chat)."""
    from attngeom.generation.answers import Answers
    from attngeom.generation.decoding import generation_stage
    from attngeom.generation.prompts import chat_template_of, prompt_ids
    from attngeom.streaming.reducers import HeadStats, TokenStats

    sink, decoding = settings.sink, settings.decoding
    stop = decoding.stop_ids(handle)
    ids = prompt_ids(handle, prompt, chat=settings.chat, system=settings.system, stop=stop)
    if sink >= len(ids):
        raise InputError(f"--sink {sink} is beyond the prompt ({len(ids)} tokens)")
    special, template = prompt_marks(handle, prompt, settings)
    sources, heads_by_answer, answers, heads, tokens = generation_stage(
        handle, run, "generate", [ids], decoding, layers=layers, desc="generate", text=2,
        make=lambda: [*answer_reducers(settings, special, template), Answers(stop), HeadStats(sink=sink),
                      TokenStats(sink=sink)])
    row = answers.result().iloc[0]
    answer_ids = [int(x) for x in str(row["answer_ids"]).split()]
    full = list(ids) + answer_ids
    tables = answer_tables(handle, sources, heads_by_answer, {0: full}, {0: len(ids)}, special, {0: template})
    chat = settings.chat or isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)
    return {"ids": full, "prompt_length": len(ids), "answer_ids": answer_ids, "stopped": bool(row["stopped"]),
            "heads": heads.result(), "tokens": tokens.result(), "tables": tables,
            "chat_template": chat_template_of(handle) if chat else None}


@takes_handle
def prompt_marks(handle: ModelHandleLike, prompt, settings: AnalyzeSettings) -> tuple[set[int], tuple[int, ...]]:
    """The tokenizer's special ids and the prompt's chat-template positions
    (:func:`attngeom.generation.prompts.template_positions`)."""
    from attngeom.generation.prompts import template_positions
    from attngeom.model.handle import special_token_ids

    return (special_token_ids(handle.tokenizer),
            template_positions(handle, prompt, chat=settings.chat, system=settings.system))


def answer_reducers(settings: AnalyzeSettings, special: set[int], template) -> list:
    """:class:`~attngeom.generation.answers.AnswerSources` and :class:`~attngeom.generation.heads.AnswerHeads`
    of one prompt, ranking special and template tokens only with ``settings.rank_special``."""
    from attngeom.generation.answers import AnswerSources
    from attngeom.generation.heads import AnswerHeads

    skip = not settings.rank_special
    return [AnswerSources(sink=settings.sink, exclude=template if skip else (), exclude_ids=special if skip else ()),
            AnswerHeads(special, template, exclude_special=skip)]


@takes_handle
def answer_tables(handle: ModelHandleLike, sources, heads, ids: dict, prompt_lengths: dict, special: set[int],
                  template: dict) -> dict:
    """The answer tables (``shares``, ``sources``, ``summary``, ``heads``) of :func:`answer_reducers`
    with token strings and, per source (or prompt position), its marks; ``ids``, ``prompt_lengths``
    and ``template`` by prompt (the tables' ``text``). ``heads`` gains ``direct_effect``: the head's
    direct effect on the generated token's logit (:func:`attngeom.generation.effects.answer_direct_effects`;
    the whole answer: the mean over its tokens)."""
    import pandas as pd

    from attngeom.generation.heads import token_marks, with_marks

    tables = {**sources.result(), "heads": with_direct_effects(handle, heads.result(), ids, prompt_lengths)}
    for name, col in (("sources", "source"), ("summary", "position")):          # heads: marked already
        df = tables[name]
        if len(df):
            parts = [with_marks(g, token_marks(ids[k], special, template[k], prompt_lengths[k]), col)
                     for k, g in df.groupby("text", sort=False)]
            tables[name] = pd.concat(parts).sort_index()
    seen = {int(x) for v in ids.values() for x in v}
    return with_token_strings(handle, tables, seen)


@takes_handle
def with_direct_effects(handle: ModelHandleLike, heads, ids: dict, prompt_lengths: dict):
    """The answer's heads table with each row's ``direct_effect`` (see :func:`answer_tables`; NaN where
    the model's norms are not RMS norms)."""
    import pandas as pd

    from attngeom.generation.effects import answer_direct_effects

    if not len(heads):
        return heads
    parts = []
    for k, g in heads.groupby("text", sort=False):
        eff = answer_direct_effects(handle, ids[k], prompt_lengths[k])
        key = {(None if pd.isna(s) else int(s), int(l), int(h)): float(x)
               for s, l, h, x in zip(eff["step"], eff["layer"], eff["head"], eff["direct_effect"])}
        g = g.copy()
        g["direct_effect"] = [key.get((None if pd.isna(s) else int(s), int(l), int(h)), float("nan"))
                              for s, l, h in zip(g["step"], g["layer"], g["head"])]
        parts.append(g)
    return pd.concat(parts).sort_index()


@takes_handle
def generation_summary(handle: ModelHandleLike, answer: dict, decoding: Decoding, sink: int = 0,
                       rank_special: bool = False) -> dict:
    """summary.json's ``generation``: the answer, how it was decoded, and for the model (mean of the
    layers) where its tokens' contribution came from, the prompt tokens (the sink aside; special and
    template tokens too unless ``rank_special``) the whole answer drew on and the heads behind it."""
    tables = answer["tables"]
    heads = tables["heads"]
    heads = heads[heads["step"].isna() & (heads["by"] == "contribution")].head(TOP_K) if len(heads) else heads
    shares = tables["shares"][tables["shares"]["layer"].isna()]
    summ = tables["summary"][tables["summary"]["layer"].isna()]
    summ = summ[summ["position"] != sink]                  # the sink has its own share
    if not rank_special:
        summ = summ[~(summ["is_special"] | summ["is_template"])]
    top = summ.sort_values(["contribution", "position"], ascending=[False, True], kind="stable").head(TOP_K)
    return {
        "heads_behind_the_answer": [
            {"layer": int(r.layer), "head": int(r.head), "source": int(r.source), "token": r.source_token,
             "part": r.part, "share": float(r.share), "rank_in_layer": int(r.rank_in_layer),
             "direct_effect": float(getattr(r, "direct_effect", float("nan")))} for r in heads.itertuples()],
        "prompt_tokens": answer["prompt_length"], "answer_tokens": len(answer["answer_ids"]),
        "chat_template": answer["chat_template"],
        "answer_text": handle.tokenizer.decode(answer["answer_ids"]), "stopped_on_stop_token": answer["stopped"],
        "decoding": {"max_new_tokens": decoding.max_new_tokens, "sample": decoding.sample,
                     "temperature": decoding.temperature, "top_p": decoding.top_p,
                     "seed": decoding.seed if decoding.seed is not None else (0 if decoding.sample else None),
                     "stop_ids": list(decoding.stop_ids(handle))},
        "mean_contribution_share": {part: float(shares[f"contribution_{part}"].mean())
                                    for part in ("sink", "prompt", "answer")},
        "prompt_tokens_the_answer_drew_on": [
            {"position": int(r.position), "token": r.token, "contribution": float(r.contribution),
             "attention": float(r.attention)} for r in top.itertuples()],
    }


@takes_handle
def answer_experiment(handle: ModelHandleLike, run: RunLike | None, prompts: Sequence,
                      settings: AnalyzeSettings, *, source: str | None = None) -> ExperimentResult:
    """Corpus mode: an answer to each of ``prompts`` (texts, or chat messages) generated with
    ``settings.decoding`` and analysed, as stage ``generate`` of ``run`` (one record per prompt:
    resumable, shared among ``torchrun`` processes); ``source`` (the file) names the prompts in
    error messages. Returns an :class:`~attngeom.runs.contract.ExperimentResult` with tables
    ``answers`` (one row per prompt: its text, the answer's text and ids) and the answer tables of
    :class:`~attngeom.generation.answers.AnswerSources` (column ``text``: the prompt's index), and the summary
    of corpus mode; ``per_window`` is empty: each prompt's numbers are its rows of the tables."""
    from attngeom.runs.contract import ExperimentResult
    from attngeom.generation.answers import Answers
    from attngeom.generation.decoding import generation_stage
    from attngeom.generation.prompts import prompt_ids

    if settings.decoding is None:
        raise InputError("corpus mode answers every prompt: give a decoding (--generate N)")
    layers = analysed_layers(handle, settings.layers)
    stop = settings.decoding.stop_ids(handle)
    ids = []
    for k, p in enumerate(prompts):
        where = f"prompt {k + 1}" + (f" of {source}" if source else "")
        try:
            ids.append(prompt_ids(handle, p, chat=settings.chat, system=settings.system, stop=stop))
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if settings.sink >= len(ids[-1]):
            raise InputError(f"{where}: --sink {settings.sink} is beyond it ({len(ids[-1])} tokens)")
    marks = [prompt_marks(handle, p, settings) for p in prompts]
    special, template = marks[0][0] if marks else set(), {k: m[1] for k, m in enumerate(marks)}
    answers, sources, heads = generation_stage(
        handle, run, "generate", ids, settings.decoding, layers=layers, desc="generate",
        make=lambda: [Answers(stop), *answer_reducers(settings, special, template)])
    answers = answers.result().sort_values("text", kind="stable").reset_index(drop=True)
    answers.insert(1, "prompt", [prompts[k] for k in answers["text"]])
    answers["answer_text"] = [handle.tokenizer.decode([int(x) for x in str(a).split()]) for a in answers["answer_ids"]]
    full = {int(k): ids[int(k)] + [int(x) for x in str(a).split()] for k, a in zip(answers["text"], answers["answer_ids"])}
    tables = answer_tables(handle, sources, heads, full, {k: len(ids[k]) for k in full}, special, template)
    tables = {"answers": answers, **{f"answer_{k}": v for k, v in tables.items()}}
    summary = {"command": "analyze", "mode": "corpus", "settings": settings.answer_record(), "prompts": len(prompts),
               "answer_tokens": int(answers["answer_tokens"].sum()),
               "stopped_on_stop_token": int(answers["stopped"].sum())}
    return ExperimentResult("analyze", tables=tables, summary=summary, settings=settings.answer_record())


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of corpus mode's report (the summary :func:`answer_experiment` returns;
    one text has its own report, :func:`attngeom.reports.analyze.report_markdown`)."""
    from attngeom.stats.resampling import format_number

    n = summary["prompts"]
    return [("prompts answered", str(n)),
            ("answer tokens (mean per prompt)", format_number(summary["answer_tokens"] / n if n else None)),
            ("answers ended on a stop token", str(summary["stopped_on_stop_token"]))]
