"""Two traces side by side: a counterfactual pair of texts, or two models on the same text.

:func:`diff` aligns the two token sequences and compares their metrics at one **target** pair of
aligned positions (default: the last one), per layer and per head.

**Alignment.** The token strings of ``a`` and ``b`` are matched by a longest-matching-blocks diff
(:class:`difflib.SequenceMatcher`, no junk heuristic): positions inside matching blocks are
*aligned* pairs ``(i_a, i_b)`` with equal tokens; every other position is *changed* (replaced,
inserted or deleted). Identical sequences align position by position. Token strings, not ids, are
compared, so two models align wherever their tokenizers cut the text the same way; fewer than half
of either trace's tokens aligned is refused (:class:`~attngeom.errors.InputError`): the texts are
not a counterfactual pair, or the tokenizers differ. Layers are compared by number (those both
traces hold); per-head differences need the same number of heads.

**What is compared**, at the target rows ``i_a``, ``i_b`` of each layer (SPEC §2):

- per source: the token-level attention (mean over heads of ``a_ij^h``) and contribution
  (``C_ij = Σ_h C_ij^h``) in ``a`` and ``b``, and ``b − a`` for aligned sources (a changed source
  has a value in one trace only) — :attr:`TraceDiff.sources`;
- per layer and per head: the rows' **distance** ``½ Σ |b − a|`` over the union of sources, a
  changed source counting against zero (for attention rows, which sum to 1, the total variation
  distance), the share of the row on changed sources in each trace, and (per head) the head share
  ``Σ_j C_ij^h`` and sink rate ``a_i0^h`` in both — :attr:`TraceDiff.layers`, :attr:`TraceDiff.heads`;
- :meth:`TraceDiff.map_diff`: ``b − a`` of a whole map, labelled with tokens, the changed tokens included.

**The prediction** (:func:`compare_texts` with ``answer`` and ``contrast`` tokens, e.g. ``" Paris"``
against ``" Berlin"``; :func:`predictions`, :func:`patch_heads`): each side's probability and logit of
the tokens at its last position and the metric ``m`` (the logit difference ``z_answer − z_contrast``,
or without a contrast ``log P(answer)``) — :attr:`TraceDiff.prediction`; and which heads carry the
difference: **activation patching**, each head's output (its slice of the output projection's input)
taken from the clean run of ``b`` into the run of ``a`` at the changed positions and, separately, at
the prediction (the last position), with the patched metric and its share of the gap ``m_b − m_a`` —
:attr:`TraceDiff.patching`. Patching needs texts of the same number of tokens (one model).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import torch

from attngeom.errors import InputError
from attngeom.model.arguments import check_handle, check_position, takes_handle, whole_number

MIN_ALIGNED = 0.5
"""Each trace must have at least this share of its tokens aligned."""
MEASURES = ("attention", "contribution")


def align(tokens_a, tokens_b) -> pd.DataFrame:
    """The alignment of two token lists (module docstring): one row per aligned pair or changed
    position, in order: ``op`` (``equal``, ``replace``, ``delete``: only in ``a``, ``insert``: only in
    ``b``), ``position_a``, ``position_b`` (null where the token is only in the other trace),
    ``token_a``, ``token_b``."""
    m = difflib.SequenceMatcher(a=list(tokens_a), b=list(tokens_b), autojunk=False)
    rows = []
    for op, a0, a1, b0, b1 in m.get_opcodes():
        if op == "equal":
            rows += [("equal", a0 + k, b0 + k) for k in range(a1 - a0)]
        else:
            rows += [(op, i, None) for i in range(a0, a1)]              # replace or delete
            rows += [(op, None, j) for j in range(b0, b1)]              # replace or insert
    df = pd.DataFrame(rows, columns=["op", "position_a", "position_b"])
    for side, toks in (("a", tokens_a), ("b", tokens_b)):
        col = df[f"position_{side}"]
        df[f"position_{side}"] = pd.array([None if pd.isna(x) else int(x) for x in col], dtype="Int64")
        df[f"token_{side}"] = [None if pd.isna(x) else toks[int(x)] for x in col]
    return df


@dataclass
class TraceDiff:
    """The comparison of traces ``a`` and ``b`` (module docstring); built by :func:`diff`."""

    a: object
    b: object
    alignment: pd.DataFrame
    target_a: int
    target_b: int
    layers_compared: list[int]
    prediction: pd.DataFrame | None = None
    patching: pd.DataFrame | None = None

    @cached_property
    def pairs(self) -> np.ndarray:
        """Aligned positions ``[n, 2]`` (``position_a``, ``position_b``)."""
        eq = self.alignment[self.alignment["op"] == "equal"]
        return eq[["position_a", "position_b"]].to_numpy(dtype=np.int64).reshape(-1, 2)

    @property
    def same_heads(self) -> bool:
        return self.heads_of(self.a) == self.heads_of(self.b)

    @staticmethod
    def heads_of(trace) -> int:
        return next(iter(trace.layers)).num_heads

    def _layer(self, trace, l: int):
        return trace.layers[l]

    def _rows(self, l: int, per_head: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The target rows of layer ``l`` in ``a`` and ``b``: ``{measure: (row_a, row_b)}``, each
        ``[H, i+1]`` (per head: ``a_ij^h`` and ``C_ij^h``) or ``[i+1]`` (token level)."""
        out = {}
        for m in MEASURES:
            rows = []
            for trace, i in ((self.a, self.target_a), (self.b, self.target_b)):
                lt = self._layer(trace, l)
                x = (lt.attention if m == "attention" else lt.contribution_inter)[:, i, :i + 1].astype(np.float64)
                rows.append(x if per_head else (x.mean(0) if m == "attention" else x.sum(0)))
            out[m] = tuple(rows)
        return out

    def _distance(self, ra: np.ndarray, rb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``½ Σ |b − a|`` over the union of sources and each row's share on changed sources
        (last axis: sources)."""
        pa, pb = self.pairs[:, 0], self.pairs[:, 1]
        ok_a, ok_b = pa <= self.target_a, pb <= self.target_b
        pa, pb = pa[ok_a & ok_b], pb[ok_a & ok_b]
        changed_a = np.ones(ra.shape[-1], bool)
        changed_a[pa] = False
        changed_b = np.ones(rb.shape[-1], bool)
        changed_b[pb] = False
        d = (np.abs(rb[..., pb] - ra[..., pa]).sum(-1) + np.abs(ra[..., changed_a]).sum(-1)
             + np.abs(rb[..., changed_b]).sum(-1)) / 2
        return d, ra[..., changed_a].sum(-1), rb[..., changed_b].sum(-1)

    @cached_property
    def layers(self) -> pd.DataFrame:
        """Per layer and measure, at the target rows: ``distance`` (½ L1 of the token-level rows),
        ``changed_share_a``/``_b`` (the row's sum on changed sources), ``output_norm_a``/``_b``."""
        rows = []
        for l in self.layers_compared:
            norms = [float(self._layer(t, l).output_norm[i]) for t, i in ((self.a, self.target_a), (self.b, self.target_b))]
            for m, (ra, rb) in self._rows(l, per_head=False).items():
                d, ca, cb = self._distance(ra, rb)
                rows.append({"layer": l, "measure": m, "distance": float(d), "changed_share_a": float(ca),
                             "changed_share_b": float(cb), "output_norm_a": norms[0], "output_norm_b": norms[1]})
        return pd.DataFrame(rows)

    @cached_property
    def heads(self) -> pd.DataFrame:
        """Per layer and head, at the target rows: for attention (``a_ij^h``) and contribution
        (``C_ij^h``) the ``{measure}_distance`` (½ L1) and ``{measure}_changed_a``/``_b``; the head share
        ``Σ_j C_ij^h`` and the sink rate ``a_i0^h`` in ``a``, ``b`` and their difference. Empty when
        the models' head counts differ."""
        if not self.same_heads:
            return pd.DataFrame()
        frames = []
        for l in self.layers_compared:
            rows = self._rows(l, per_head=True)
            H = rows["attention"][0].shape[0]
            df = pd.DataFrame({"layer": l, "head": np.arange(H)})
            for m, (ra, rb) in rows.items():
                d, ca, cb = self._distance(ra, rb)
                df[f"{m}_distance"], df[f"{m}_changed_a"], df[f"{m}_changed_b"] = d, ca, cb
            (ca_, cb_), (aa, ab) = rows["contribution"], rows["attention"]
            df["head_share_a"], df["head_share_b"] = ca_.sum(-1), cb_.sum(-1)
            df["head_share_diff"] = df["head_share_b"] - df["head_share_a"]
            df["sink_rate_a"], df["sink_rate_b"] = aa[:, 0], ab[:, 0]
            df["sink_rate_diff"] = df["sink_rate_b"] - df["sink_rate_a"]
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    @cached_property
    def sources(self) -> pd.DataFrame:
        """Per layer and source of the target rows (aligned pairs and changed positions, in
        alignment order): ``op``, ``position_a``/``_b``, ``token_a``/``_b``, ``{measure}_a``/``_b``
        (token level) and ``{measure}_diff`` (``b − a``, aligned sources only)."""
        al = self.alignment
        pa, pb = al["position_a"], al["position_b"]
        keep = (pa.isna() | (pa <= self.target_a)) & (pb.isna() | (pb <= self.target_b))
        al = al[keep.fillna(False).astype(bool)].reset_index(drop=True)
        ia = al["position_a"].fillna(-1).to_numpy(np.int64)
        ib = al["position_b"].fillna(-1).to_numpy(np.int64)
        frames = []
        for l in self.layers_compared:
            df = al.copy()
            df.insert(0, "layer", l)
            for m, (ra, rb) in self._rows(l, per_head=False).items():
                df[f"{m}_a"] = np.where(ia >= 0, ra[np.maximum(ia, 0)], np.nan)
                df[f"{m}_b"] = np.where(ib >= 0, rb[np.maximum(ib, 0)], np.nan)
                df[f"{m}_diff"] = df[f"{m}_b"] - df[f"{m}_a"]
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    def map_diff(self, layer: int, measure: str = "contribution", head: int | None = None) -> pd.DataFrame:
        """``b − a`` of layer ``layer``'s map over the whole alignment: a ``[n, n]`` table (queries x
        sources, in alignment order; zero above the diagonal), rows and columns labelled
        ``"{position_a}/{position_b} {token}"`` for an aligned pair, ``"a{position} {token}"`` or
        ``"b{position} {token}"`` for a changed token: its value in the one trace that has it (``b``'s
        positive, ``a``'s negated; a cell between tokens of different traces is NaN). ``head`` None:
        token level (attention: mean over heads; contribution: ``C_ij``); else that head's ``a_ij^h`` or
        ``C_ij^h``."""
        if measure not in MEASURES:
            raise InputError(f"measure must be one of {', '.join(MEASURES)}, not {measure!r}")
        if layer not in self.layers_compared:
            raise InputError(f"layer {layer} is not in both traces; compared: {self.layers_compared}")
        if head is not None and not (self.same_heads and 0 <= head < self.heads_of(self.a)):
            raise InputError(f"head {head} cannot be compared (the traces have {self.heads_of(self.a)} and "
                             f"{self.heads_of(self.b)} heads)")
        maps = []
        for trace in (self.a, self.b):
            lt = self._layer(trace, layer)
            x = lt.attention if measure == "attention" else lt.contribution_inter
            maps.append((x[head] if head is not None else (x.mean(0) if measure == "attention" else x.sum(0)))
                        .astype(np.float64))
        al = self.alignment
        ia = al["position_a"].fillna(-1).to_numpy(np.int64)
        ib = al["position_b"].fillna(-1).to_numpy(np.int64)
        n = len(al)
        out = np.full((n, n), np.nan)
        both = (ia >= 0) & (ib >= 0)
        ea, eb = ia >= 0, ib >= 0
        a_part = np.zeros((n, n))
        b_part = np.zeros((n, n))
        a_part[np.ix_(ea, ea)] = maps[0][np.ix_(ia[ea], ia[ea])]
        b_part[np.ix_(eb, eb)] = maps[1][np.ix_(ib[eb], ib[eb])]
        out[np.ix_(both, both)] = (b_part - a_part)[np.ix_(both, both)]
        only_a, only_b = ea & ~eb, eb & ~ea
        for rows, cols, val in ((ea, only_a, -a_part), (only_a, ea, -a_part), (eb, only_b, b_part), (only_b, eb, b_part)):
            out[np.ix_(rows, cols)] = val[np.ix_(rows, cols)]
        labels = [(f"{int(a)}/{int(b)} {ta}" if o == "equal" else
                   (f"a{int(a)} {ta}" if a >= 0 else f"b{int(b)} {tb}"))
                  for o, a, b, ta, tb in zip(al["op"], ia, ib, al["token_a"], al["token_b"])]
        return pd.DataFrame(out, index=labels, columns=labels)

    def summary(self) -> dict:
        """A JSON-able overview: models, lengths, alignment counts, the target, per measure the
        layer whose target rows differ most, and (when computed) the prediction and the five heads
        per place whose patching moves the metric most."""
        counts = self.alignment["op"].value_counts().to_dict()
        worst = {}
        for m, g in self.layers.groupby("measure"):
            r = g.sort_values(["distance", "layer"], ascending=[False, True]).iloc[0]
            worst[m] = {"layer": int(r["layer"]), "distance": float(r["distance"])}
        out = {"model_a": self.a.model_name, "model_b": self.b.model_name, "tokens_a": len(self.a),
                "tokens_b": len(self.b), "aligned": int(counts.get("equal", 0)),
                "changed_a": int(((self.alignment["op"] != "equal") & self.alignment["position_a"].notna()).sum()),
                "changed_b": int(((self.alignment["op"] != "equal") & self.alignment["position_b"].notna()).sum()),
                "target": {"position_a": self.target_a, "position_b": self.target_b,
                           "token": self.a.tokens[self.target_a]},
                "layers": self.layers_compared, "most_different_layer": worst}
        if self.prediction is not None:
            out["prediction"] = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()}
                                 for r in self.prediction.to_dict("records")]
        if self.patching is not None:
            top = self.patching[self.patching["rank"] < 5]
            out["patching"] = {"metric": self.patching.attrs["metric"], "m_a": self.patching.attrs["m_a"],
                               "m_b": self.patching.attrs["m_b"],
                               "top": [{"at": r.at, "layer": int(r.layer), "head": int(r.head),
                                        "effect": float(r.effect), "share_of_gap": float(r.share_of_gap)}
                                       for r in top.itertuples()]}
        return out

    def __repr__(self) -> str:
        s = self.summary()
        return (f"TraceDiff({s['model_a']} vs {s['model_b']}: {s['aligned']} aligned tokens, {s['changed_a']} changed "
                f"in a, {s['changed_b']} in b; target {self.target_a}/{self.target_b} {s['target']['token']!r}, "
                f"{len(self.layers_compared)} layer(s))")


def aligned(tokens_a, tokens_b) -> pd.DataFrame:
    """:func:`align` of two token lists, refused in one line when fewer than :data:`MIN_ALIGNED` of
    either's tokens align (checked on the tokens alone: before any analysis, in :func:`compare_texts`)."""
    al = align(tokens_a, tokens_b)
    n = int((al["op"] == "equal").sum())
    for name, t in (("a", tokens_a), ("b", tokens_b)):
        if n < MIN_ALIGNED * len(t):
            raise InputError(f"only {n} of trace {name}'s {len(t)} tokens align with the other trace: compare a "
                             "counterfactual pair (texts that differ in a few tokens) or two models with the same "
                             "tokenizer on the same text")
    return al


def diff(a, b, *, target: int | None = None) -> TraceDiff:
    """Compare traces ``a`` and ``b`` (:class:`attngeom.traces.trace.Trace`; module docstring).
    ``target``: a position of ``a`` that is aligned (negative counts from the end); default the last
    aligned position. Refused in one line: anything but two traces, traces too different to align, no
    layer in common, a target that is not a position of ``a`` or not aligned."""
    from attngeom.traces.trace import Trace

    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Trace):
            raise InputError(f"diff compares two traces (attngeom.analyze(...) or Trace.load(...)); {name} is "
                             f"{'None' if t is None else 'a value of type ' + type(t).__name__}")
    ta = None if target is None else check_position(target, "target", len(a), "trace a")
    al = aligned(a.tokens, b.tokens)
    layers = sorted({lt.index for lt in a.layers} & {lt.index for lt in b.layers})
    if not layers:
        raise InputError(f"the traces hold no layer in common (a: {[lt.index for lt in a.layers]}, "
                         f"b: {[lt.index for lt in b.layers]})")
    eq = al[al["op"] == "equal"]
    if ta is None:
        ta, tb = int(eq["position_a"].iloc[-1]), int(eq["position_b"].iloc[-1])
    else:
        hit = eq[eq["position_a"] == ta]
        if not len(hit):
            raise InputError(f"position {ta} of trace a ({a.tokens[ta]!r}) has no counterpart in b; "
                             "give an aligned target")
        tb = int(hit["position_b"].iloc[0])
    return TraceDiff(a=a, b=b, alignment=al, target_a=ta, target_b=tb, layers_compared=layers)


def tables(d: TraceDiff) -> dict[str, pd.DataFrame]:
    """The tables a comparison writes: ``alignment``, ``layers``, ``heads`` (empty when the head counts
    differ) and ``sources`` of :class:`TraceDiff`, and ``prediction`` and ``patching`` when computed."""
    out = {"alignment": d.alignment, "layers": d.layers, "heads": d.heads, "sources": d.sources}
    out.update({name: df for name, df in (("prediction", d.prediction), ("patching", d.patching)) if df is not None})
    return out


@takes_handle
def predictions(handle, texts, answer, contrast=None) -> pd.DataFrame:
    """Each text's next-token prediction of ``answer`` (and ``contrast``) tokens: one row per text
    (``side`` a, b, ...) and token: ``token``, ``token_id``, ``role`` (answer/contrast), ``p``,
    ``logit``, and the metric ``m`` of the side (logit difference, or log P(answer))."""
    from attngeom.generation.effects import Answer, head_inputs
    from attngeom.streaming.passes import to_ids

    ans = Answer(handle, answer, contrast)
    rows = []
    for side, text in zip("abcdefgh", texts):
        logits = head_inputs(handle, to_ids(handle, text))[1][-1]
        p = torch.softmax(logits.double(), -1)
        m = float(ans.score(logits))
        for role, t in (("answer", ans.target), ("contrast", ans.contrast)):
            if t is not None:
                rows.append({"side": side, "role": role, "token": handle.tokens([t])[0], "token_id": t,
                             "p": float(p[t]), "logit": float(logits[t]), "metric": ans.name, "m": m})
    return pd.DataFrame(rows)


PATCH_AT = ("changed", "prediction", "all")
"""Where :func:`patch_heads` patches a head's output: the changed positions, the last, or every one."""


@takes_handle
def patch_heads(handle, text_a, text_b, answer, *, contrast=None, at=("changed", "prediction"),
                layers=None, batch_size: int = 16) -> pd.DataFrame:
    """Activation patching (module docstring): each head's output from the clean run of ``text_b``
    into the run of ``text_a``, one head at a time, at each place of ``at`` (:data:`PATCH_AT`). One
    row per (``at``, ``layer``, ``head``): ``patched`` (the metric ``m`` of ``a`` so patched),
    ``effect`` (``patched − m_a``) and ``share_of_gap`` (``effect / (m_b − m_a)``), ranked by
    ``|effect|`` within each ``at`` (``rank``, 0 first). ``df.attrs``: ``metric``, ``m_a``, ``m_b``,
    ``changed`` (the positions that differ)."""
    from attngeom.data.corpora import check_layers
    from attngeom.generation.effects import Answer, chunks, head_inputs, patched_logits
    from attngeom.model.arguments import check_count
    from attngeom.streaming.passes import to_ids

    at = (at,) if isinstance(at, str) else tuple(at)
    bad = [x for x in at if x not in PATCH_AT]
    if bad or not at:
        raise InputError(f"at must name places among {', '.join(PATCH_AT)}, not {bad[0] if bad else at!r}"[:200])
    batch_size = check_count(batch_size, "batch_size")
    chosen = list(range(handle.num_layers)) if layers is None else sorted(set(check_layers(layers, handle.num_layers)))
    ans = Answer(handle, answer, contrast)
    ids_a, ids_b = to_ids(handle, text_a), to_ids(handle, text_b)
    if len(ids_a) != len(ids_b):
        raise InputError(f"patching needs two texts of the same number of tokens (a: {len(ids_a)}, b: {len(ids_b)}); "
                         "reword the counterfactual so that one token replaces one token")
    T = len(ids_a)
    changed = [i for i in range(T) if ids_a[i] != ids_b[i]]
    if not changed:
        raise InputError("the two texts are the same tokens: nothing to patch")
    source, logits_b = head_inputs(handle, ids_b)
    logits_a = head_inputs(handle, ids_a)[1]
    m_a, m_b = float(ans.score(logits_a[-1])), float(ans.score(logits_b[-1]))
    places = {"changed": changed, "prediction": [T - 1], "all": list(range(T))}
    heads = [(l, h) for l in chosen for h in range(handle.num_heads)]
    frames = []
    for where in at:
        patched = []
        for chunk in chunks(heads, batch_size):
            logits = patched_logits(handle, ids_a, source, [[lh] for lh in chunk], places[where])
            patched += ans.score(logits[:, -1]).cpu().tolist()
        df = pd.DataFrame({"at": where, "layer": [l for l, _ in heads], "head": [h for _, h in heads],
                           "patched": patched})
        df["effect"] = df["patched"] - m_a
        gap = m_b - m_a
        df["share_of_gap"] = df["effect"] / gap if gap != 0 else np.nan
        order = np.argsort(-df["effect"].abs().to_numpy(), kind="stable")
        df["rank"] = np.empty(len(df), dtype=np.int64)
        df.loc[order, "rank"] = np.arange(len(df))
        frames.append(df.sort_values("rank", kind="stable"))
    out = pd.concat(frames, ignore_index=True)
    out.attrs.update({"metric": ans.name, "m_a": m_a, "m_b": m_b, "changed": changed})
    return out


@takes_handle
def compare_texts(handle, text, *, text_b=None, handle_b=None, layers=None, target: int | None = None,
                  answer=None, contrast=None, patch: bool = True):
    """Analyse ``text`` with ``handle`` and ``text_b`` (default ``text``) with ``handle_b`` (default
    ``handle``) and compare them: ``(trace_a, trace_b, diff)``. A counterfactual pair is one model and
    two texts; two models take the same text (and need a tokenizer that cuts it the same way).
    ``answer`` (and ``contrast``): tokens whose next-token prediction each side reports
    (``diff.prediction``, :func:`predictions`); with ``patch`` and one model on texts of equal token
    counts, ``diff.patching`` (:func:`patch_heads`, at the changed positions and at the prediction)."""
    from attngeom.data.corpora import check_layers
    from attngeom.traces.trace import analyze

    handle_b = handle if handle_b is None else check_handle(handle_b, "attngeom.traces.compare_texts")
    if target is not None:
        whole_number(target, "target")          # its range is known once the texts are read
    if layers is not None:
        for h in (handle, handle_b):
            check_layers(layers, h.num_layers)
    if text_b is None and handle_b is handle:
        raise InputError("nothing to compare: give a second text (a counterfactual) or a second model")
    from attngeom.streaming.passes import to_ids

    text_b = text if text_b is None else text_b
    aligned(handle.tokens(to_ids(handle, text)), handle_b.tokens(to_ids(handle_b, text_b)))   # before any analysis
    if contrast is not None and answer is None:
        raise InputError("a contrast token needs an answer token (answer=' Paris', contrast=' Berlin')")
    if answer is not None:
        from attngeom.generation.effects import Answer

        for h in {id(handle): handle, id(handle_b): handle_b}.values():
            Answer(h, answer, contrast)                                  # one token each, before any analysis
    a = analyze(handle, text, layers=layers)
    b = analyze(handle_b, text_b, layers=layers)
    d = diff(a, b, target=target)
    if answer is not None:
        pa, pb = predictions(handle, [text], answer, contrast), predictions(handle_b, [text_b], answer, contrast)
        pb["side"] = "b"
        d.prediction = pd.concat([pa, pb], ignore_index=True)
        if patch and handle_b is handle and len(a) == len(b):
            d.patching = patch_heads(handle, text, text_b, answer, contrast=contrast, layers=layers)
    return a, b, d
