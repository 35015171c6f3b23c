"""The explorer page in a real browser: headless Chromium driven by selenium.

``make test`` installs Chromium and its driver where it can (root on Debian) and selenium with the
``test`` extra; where neither is possible these tests are skipped with the reason. Any JavaScript
console error fails a test. Screenshots are kept in ``out/test-artifacts/``.

No test waits on a clock: each waits until the page says it is ready (the explorer's and the compare
page's ``body[data-ready]``) or until a condition the page shows holds (:func:`wait_until`), and
fails with what the page showed. :data:`WAIT_S` bounds only a page that never gets there, so the
tests pass on a loaded machine (they are run beside CPU-bound jobs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from attngeom.explorer import data as E
from attngeom.reports import explore as R

ARTIFACTS = Path(__file__).resolve().parents[2] / "out" / "test-artifacts"
CHROME_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--window-size=1400,1100"]
TEXT = "The cat sat on the mat; the dog lay by the door, and the cat saw it."
NASTY = ["<s>", "<script>alert(1)</script>", "</script><!--", "\"quoted\" 'single'", "back\\slash\\",
         "a|b||c", "cr\rlf\n", "שלום עולם", "مرحبا", "😀👍🏽", "&amp; &lt;", "\u2028\u2029", "<b>bold</b>",
         "<img src=x onerror=alert(2)>"]


def _find(*names: str) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def _unavailable(reason: str):
    """Skip, or fail where the browser must be there (``make test`` as root on Debian sets
    ATTNGEOM_REQUIRE_BROWSER=1)."""
    if os.environ.get("ATTNGEOM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}, but ATTNGEOM_REQUIRE_BROWSER=1 (make test could have installed it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    chrome = _find("chromium", "chromium-browser", "google-chrome")
    chromedriver = _find("chromedriver")
    if not chrome or not chromedriver:
        _unavailable("no Chromium/chromedriver on PATH: `make test` installs them as root on Debian "
                     "(apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in CHROME_ARGS:
        opts.add_argument(a)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(chromedriver), options=opts)
    yield d
    d.quit()


WAIT_S = 300.0
"""How long a page may take to get where a test waits for it: a bound for a page that never does,
not a time it is expected to take."""


def what_the_page_shows(driver) -> str:
    """A one-line account of the current page (or frame) for a failure message."""
    seen = driver.execute_script("""
        var b = document.body;
        return b ? {ready: b.dataset.ready, synced: b.dataset.synced, syncedFrom: b.dataset.syncedFrom,
                    query: Array.from(document.querySelectorAll('#tokens .tok.query')).map(function (t) { return t.dataset.pos; }),
                    text: b.innerText.slice(0, 300)} : null;""")
    return json.dumps(seen)


def wait_until(driver, script: str, what: str, timeout: float = WAIT_S):
    """Poll ``script`` (JavaScript returning a value) until it is truthy and return the value; fail,
    saying ``what`` was awaited and what the page showed, if it is not within ``timeout`` s."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: d.execute_script(script))
    except TimeoutException:
        pytest.fail(f"{what}: not within {timeout:g} s; the page showed {what_the_page_shows(driver)}; "
                    f"console errors: {console_errors(driver)}")


def wait_ready(driver) -> float:
    """Wait until the explorer in the current page or frame says it is ready (``body[data-ready]``:
    "1", or "error" when it could not read its data); returns its time to interactive (ms)."""
    state = wait_until(driver, "return document.body && document.body.dataset.ready", "the explorer to get ready")
    assert state == "1", f"the explorer could not start: {what_the_page_shows(driver)}"
    return float(driver.execute_script("return window.exploreReadyMs"))


def open_page(driver, path: Path) -> float:
    """Open ``path``, wait until the page says it is ready; returns its time to interactive (ms)."""
    driver.get(path.resolve().as_uri())
    return wait_ready(driver)


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def shot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    p = ARTIFACTS / name
    driver.save_screenshot(str(p))
    assert p.stat().st_size > 0
    return p


def top_shown(driver, metric: str) -> int:
    row = driver.find_element("css selector", f'#src-{metric} tr.src[data-rank="0"]')
    return int(row.get_attribute("data-pos"))


def select(driver, element_id: str, value) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(str(value))


@pytest.fixture(scope="module")
def page(tiny_llama, tmp_path_factory):
    data = E.build(tiny_llama, TEXT)
    path = tmp_path_factory.mktemp("explore") / "explore.html"
    R.write(data, path)
    return data, path


def check_view(driver, data, layer, head, query):
    """The sources tables show the top source Python computed for each metric (waiting, should the
    page still be drawing them)."""
    want = {m: data.top_source(layer, head, query, m) for m in E.SHOWN}
    script = "return " + " && ".join(
        f'(function (r) {{ return r !== null && r.dataset.pos === "{want[m]}"; }})'
        f'(document.querySelector(\'#src-{m} tr.src[data-rank="0"]\'))' for m in E.SHOWN)
    if not driver.execute_script(script):
        wait_until(driver, script, f"the top sources {want} (layer {layer}, head {head}, query {query})")
    for metric in E.SHOWN:
        assert top_shown(driver, metric) == want[metric], (metric, layer, head, query)


def test_click_token_grid_metric_layer(driver, page):
    data, path = page
    assert open_page(driver, path) > 0             # the page reports its time to interactive (no bound: machines differ)
    T, H = data.T, data.num_heads
    last = data.layers[-1]
    # the initial view: last layer, all heads, last token
    check_view(driver, data, last, None, T - 1)
    # click a token: it is pinned and its sources are shown
    q = 7
    driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').click()
    check_view(driver, data, last, None, q)
    assert "query" in driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').get_attribute("class")
    # the highlight metric colours the visible tokens by attention instead of contribution
    src_tok = driver.find_element("css selector", f'#tokens .tok[data-pos="{data.top_source(last, None, q, "attention")}"]')
    assert "contribution" in src_tok.get_attribute("title")
    select(driver, "hl", "attention")
    assert "attention" in src_tok.get_attribute("title") and src_tok.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
    assert "invisible" in driver.find_element("css selector", f'#tokens .tok[data-pos="{q + 1}"]').get_attribute("class")
    # a grid cell picks the layer and the head
    layer_k, head = 0, H - 1
    driver.find_element("css selector", f'#grid td.cell[data-layer="{layer_k}"][data-head="{head}"]').click()
    assert driver.find_element("id", "layer").get_attribute("value") == str(layer_k)
    assert driver.find_element("id", "head").get_attribute("value") == str(head)
    check_view(driver, data, data.layers[layer_k], head, q)
    # switch the layer with the selector, then back to the whole layer
    select(driver, "layer", 1)
    check_view(driver, data, data.layers[1], head, q)
    select(driver, "head", -1)
    check_view(driver, data, data.layers[1], None, q)
    # switch the grid statistic: regime names as Python computed them
    select(driver, "stat", "regime")
    cell = driver.find_element("css selector", '#grid td.cell[data-layer="1"][data-head="0"]')
    regime = ("Retriever", "Mixer", "Reset")[int(data.head_stats["regime"][1][0])]
    assert regime in cell.get_attribute("title")
    select(driver, "stat", "head_share")
    cell = driver.find_element("css selector", '#grid td.cell[data-layer="1"][data-head="0"]')
    assert "head_share" in cell.get_attribute("title")
    # the flow graph from the pinned token equals the Python flow
    f = E.flow([data.transfer_rows(l) for l in data.layers], q, T)[0]
    js = dict(driver.execute_script(f"return window.attngeomFlow({q})"))
    for j in range(T):
        assert js.get(j, 0.0) == pytest.approx(f[j], abs=1e-4)
    top_li = driver.find_element("css selector", "#flowtop li")
    assert int(top_li.get_attribute("data-pos")) == int(np.argmax(f))
    assert len(driver.find_elements("css selector", "#flowsvg circle")) > 0
    assert len(driver.find_elements("css selector", "#sinksvg polyline")) == 3
    shot(driver, "explore-tiny.png")
    assert console_errors(driver) == []


def test_hover_and_jupyter_iframe(driver, page, tiny_llama, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    data, path = page
    open_page(driver, path)
    q = 5
    ActionChains(driver).move_to_element(driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]')).perform()
    check_view(driver, data, data.layers[-1], None, q)          # hover shows the sources, unpinned
    assert console_errors(driver) == []
    # the Jupyter view (trace.explore()): the same page inside <iframe srcdoc sandbox="allow-scripts">
    from attngeom import analyze

    trace = analyze(tiny_llama, TEXT)
    frame_page = tmp_path / "notebook.html"
    frame_page.write_text(f"<!DOCTYPE html><html><body>{trace.explore()._repr_html_()}</body></html>", encoding="utf-8")
    driver.get(frame_page.resolve().as_uri())
    driver.switch_to.frame(driver.find_element("tag name", "iframe"))
    wait_ready(driver)
    d2 = E.from_trace(trace)
    check_view(driver, d2, d2.layers[-1], None, d2.T - 1)
    assert "Not available" in driver.find_element("id", "flownote").text   # no residual stream in a Trace
    driver.switch_to.default_content()
    assert console_errors(driver) == []


def test_topk_page(driver, tiny_llama, tmp_path):
    data = E.build(tiny_llama, TEXT, top_k=4, exact_max_tokens=8)
    assert not data.exact
    path = R.write(data, tmp_path / "topk.html")
    open_page(driver, path)
    T = data.T
    for q in (3, T - 1):
        driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').click()
        check_view(driver, data, data.layers[-1], None, q)
        assert len(driver.find_elements("css selector", "#src-attention tr.src")) == min(4, q + 1)
        driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').click()  # unpin
    driver.find_element("css selector", '#grid td.cell[data-layer="0"][data-head="1"]').click()
    check_view(driver, data, data.layers[0], 1, T - 1)
    assert console_errors(driver) == []


def shown_sources(driver, table: str) -> list[tuple[int, float]]:
    """(position, value as printed) of the rows a sources table lists, in its order."""
    return [(int(r.get_attribute("data-pos")), float(r.find_element("css selector", "td.val").text))
            for r in driver.find_elements("css selector", f"#{table} tr.src")]


def test_measure_column(driver, tiny_llama, tmp_path):
    """--measure: a third list of sources, the measure's as Python stored it, for the whole layer and
    per head; the highlight selector offers it; a layer-only measure (ALTI) says in the per-head view
    that it has no per-head form and shows no numbers there."""
    from attngeom.metrics import registry

    for name in ("value_zeroing", "alti"):
        data = E.build(tiny_llama, TEXT, measure=name)
        open_page(driver, R.write(data, tmp_path / f"{name}.html"))
        label, last, q = registry.label(name), data.layers[-1], 7
        assert driver.find_element("id", "measurelabel").text == label
        driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').click()
        check_view(driver, data, last, None, q)
        for head in (None, 1):
            select(driver, "head", -1 if head is None else head)
            got = shown_sources(driver, "src-measure")
            if head is not None and registry.get(name).layer_only:
                assert got == []
                assert "no per-head form" in driver.find_element("css selector", "#src-measure td.none").text
                assert "no per-head form" in driver.find_element("id", "srcnote").text
                continue
            want = data.sources(last, head, q, name)[:10]
            assert [p for p, _ in got] == [p for p, _ in want], (name, head)
            for (_, x), (_, y) in zip(got, want):
                assert x == pytest.approx(y, rel=1e-2, abs=5e-4)
        select(driver, "head", -1)
        select(driver, "hl", name)                       # the highlight: coloured by the measure
        top = driver.find_element("css selector", f'#tokens .tok[data-pos="{data.top_source(last, None, q, name)}"]')
        assert label in top.get_attribute("title") and top.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
        shot(driver, f"explore-measure-{name}.png")
        assert console_errors(driver) == []


def test_token_text_is_data(driver, tiny_llama, tmp_path):
    ids = tiny_llama.encode("x" * (len(NASTY) + 4))[: len(NASTY)]
    data = E.build(tiny_llama, ids)
    data.tokens = list(NASTY)
    path = R.write(data, tmp_path / "nasty.html")
    open_page(driver, path)
    assert driver.execute_script("return JSON.parse(document.getElementById('explore-data').textContent).tokens") == NASTY
    spans = driver.find_elements("css selector", "#tokens .tok")
    assert len(spans) == len(NASTY)
    shown = driver.execute_script("return Array.from(document.querySelectorAll('#tokens .tok')).map(s => s.textContent)")
    visible = {"\n": "\u21b5", "\t": "\u2192", "\r": "\u23ce"}
    expect = ["".join(visible.get(c, f"\\x{ord(c):02x}") if ord(c) < 32 else c for c in t) for t in NASTY]
    assert shown == expect
    # nothing became markup: no element inside a token, no extra script or image, no alert
    assert driver.execute_script("return document.querySelectorAll('#tokens .tok *').length") == 0
    assert driver.execute_script("return document.scripts.length") == 2
    assert driver.execute_script("return document.images.length") == 0
    # the sources table shows tokens literally too
    driver.find_element("css selector", f'#tokens .tok[data-pos="{len(NASTY) - 1}"]').click()
    cells = driver.execute_script("return Array.from(document.querySelectorAll('#src-attention td.tk')).map(s => s.textContent)")
    assert set(cells) <= set(expect) and cells
    shot(driver, "explore-tokens.png")
    assert console_errors(driver) == []


@pytest.mark.slow
def test_bundled_model_sample(driver, smollm2, tmp_path):
    """The bundled model on the built-in sample text (what ``make demo`` writes)."""
    from attngeom.data.corpora import SAMPLE_TEXT

    data = E.build(smollm2, SAMPLE_TEXT)
    path = R.write(data, tmp_path / "explore.html")
    assert open_page(driver, path) > 0   # ~1-3 s on the shared 2-core machine; the 3 s target at T = 2048: docs/explore.md
    check_view(driver, data, data.layers[-1], None, data.T - 1)
    q = data.T // 2
    driver.find_element("css selector", f'#tokens .tok[data-pos="{q}"]').click()
    check_view(driver, data, data.layers[-1], None, q)
    select(driver, "layer", 5)
    select(driver, "head", 3)
    check_view(driver, data, data.layers[5], 3, q)
    shot(driver, "explore-smollm2.png")
    assert console_errors(driver) == []


def test_answer_view(driver, tiny_llama, tmp_path):
    """A generation: the answer is underlined, an answer token shows the row that predicted it
    (or its own row with the box unticked), and the answer summary lists the prompt tokens the whole
    answer drew on, as Python computed them."""
    from attngeom.generation.decoding import Decoding

    data = E.build(tiny_llama, "The cat sat", decoding=Decoding(6, stop=()))
    P, T = data.answer["prompt_length"], data.T
    path = R.write(data, tmp_path / "answer.html")
    open_page(driver, path)
    last = data.layers[-1]
    answer = [int(s.get_attribute("data-pos")) for s in driver.find_elements("css selector", "#tokens .tok.answer")]
    assert answer == list(range(P, T))
    # the page opens on the first answer token's prediction (row P - 1)
    check_view(driver, data, last, None, P - 1)
    assert "target" in driver.find_element("css selector", f'#tokens .tok[data-pos="{P}"]').get_attribute("class")
    t = P + 3
    driver.find_element("css selector", f'#tokens .tok[data-pos="{t}"]').click()
    check_view(driver, data, last, None, t - 1)
    assert f"answer token {t} (row {t - 1})" in driver.find_element("id", "srctitle").text
    driver.find_element("css selector", f'#tokens .tok[data-pos="{t}"]').click()      # unpin
    driver.find_element("id", "pred").click()                                         # untick: the token's own row
    driver.find_element("css selector", f'#tokens .tok[data-pos="{t}"]').click()
    check_view(driver, data, last, None, t)
    # which prompt tokens the whole answer drew on: mean contribution over the producing rows
    for table, scores in (("answer-model", data.answer["model"]["contribution"]),
                          ("answer-layer", data.answer["layers"]["contribution"][len(data.layers) - 1])):
        shown = [int(r.get_attribute("data-pos")) for r in driver.find_elements("css selector", f"#{table} tr.src")]
        want = sorted((j for j in range(P) if j != data.sink), key=lambda j: (-scores[j], j))[:10]
        assert shown == want, table
    shot(driver, "explore-answer.png")
    assert console_errors(driver) == []


def test_sink_chart_draws_no_line_across_layers_not_analysed(driver, tmp_path):
    """Layers 0, 1 and 3 of four: each series of the sink chart is one line from layer 0 to layer 1
    and a lone point at layer 3, never a segment across the missing layer 2; with layers 0 and 2
    only, no line at all (two lone points per series)."""
    from tiny_models import tiny_model

    handle = tiny_model("llama", num_hidden_layers=4)
    for layers, lines in (([0, 1, 3], [["0", "1"]] * 3), ([0, 2], [])):
        data = E.build(handle, TEXT, layers=layers)
        path = R.write(data, tmp_path / f"sinks-{'-'.join(map(str, layers))}.html")
        open_page(driver, path)
        points = driver.execute_script("""
            var svg = document.getElementById("sinksvg"), x = {};
            svg.querySelectorAll("circle").forEach(function (c) {
              x[(+c.getAttribute("cx")).toFixed(1)] = c.querySelector("title").textContent.match(/layer (\\d+)/)[1]; });
            return Array.prototype.map.call(svg.querySelectorAll("polyline"), function (p) {
              return p.getAttribute("points").trim().split(/\\s+/).map(function (xy) { return x[xy.split(",")[0]]; }); });""")
        assert points == lines, (layers, points)
        assert len(driver.find_elements("css selector", "#sinksvg circle")) == 3 * len(layers)
        assert "not analysed" in driver.find_element("tag name", "body").text
        assert console_errors(driver) == []


def test_the_answer_target_outline_is_in_the_legend(driver, tiny_llama, tmp_path):
    """A generation: the dashed outline marking the answer token predicted has its legend entry,
    drawn with the same outline; a page without an answer hides it."""
    from attngeom.generation.decoding import Decoding

    data = E.build(tiny_llama, "The cat sat", decoding=Decoding(3, stop=()))
    open_page(driver, R.write(data, tmp_path / "target.html"))
    entry = driver.find_element("id", "targetlegend")
    assert entry.is_displayed() and "target: the answer token predicted" in entry.text
    swatch = entry.find_element("css selector", ".sw").value_of_css_property("outline-style")
    target = driver.find_element("css selector", "#tokens .tok.target").value_of_css_property("outline-style")
    assert swatch == target == "dashed"
    assert driver.find_element("id", "answerlegend").is_displayed()
    open_page(driver, R.write(E.build(tiny_llama, "The cat sat"), tmp_path / "plain.html"))
    assert not driver.find_element("id", "targetlegend").is_displayed()
    assert console_errors(driver) == []


def test_heads_behind_a_token_and_the_split_by_head(driver, tmp_path):
    """The heads panel lists the (layer, head, source) triples of Trace.heads_for for the shown row;
    hovering a source splits its link by head (C_ij^h, a_ij^h / H); special and chat-template tokens
    are marked and, with the box ticked, left out of the rankings."""
    from attngeom.traces.trace import analyze
    from tiny_models import tiny_chat_tokenizer, tiny_model

    handle = tiny_model("llama")
    handle.tokenizer = tiny_chat_tokenizer()
    trace = analyze(handle, "The cat sat", generate=4, chat=True, stop=())
    path = trace.to_html(tmp_path / "heads.html")
    open_page(driver, path)
    marked = {int(s.get_attribute("data-pos")) for s in driver.find_elements("css selector", "#tokens .tok.marked")}
    assert marked == set(trace.special) | set(trace.template) and marked
    t = trace.prompt_length + 2                                        # an answer token: its prediction row
    driver.find_element("css selector", f'#tokens .tok[data-pos="{t}"]').click()
    rows = driver.find_elements("css selector", "#headstable tr.hrow")
    want = trace.heads_for(t, top=len(rows), exclude_special=False)
    got = [(int(r.get_attribute("data-layer")), int(r.get_attribute("data-head")), int(r.get_attribute("data-pos")))
           for r in rows]
    shares = [float(r.find_elements("tag name", "td")[4].text) for r in rows]
    assert np.allclose(shares, want["share"], atol=2e-3)               # float16 on the page
    assert got[0] == tuple(want.iloc[0][["layer", "head", "source"]])
    # the split of one link by head, at the shown layer
    src = driver.find_element("css selector", '#src-contribution tr.src[data-rank="0"]')
    j = int(src.get_attribute("data-pos"))
    from selenium.webdriver import ActionChains

    ActionChains(driver).move_to_element(src).perform()
    cells = driver.find_elements("css selector", "#split tr.split")
    C = trace.layers.values()[-1].contribution_inter[:, t - 1, j]
    assert np.allclose([float(c.find_elements("tag name", "td")[1].text) for c in cells], C, atol=2e-3)
    # leave special and template tokens out of the rankings
    driver.find_element("id", "skipmarked").click()
    listed = {int(r.get_attribute("data-pos")) for r in driver.find_elements("css selector", "#headstable tr.hrow")}
    listed |= {int(r.get_attribute("data-pos")) for r in driver.find_elements("css selector", "#sources tr.src, .sources tr.src")}
    assert listed and not listed & marked
    assert {int(r.get_attribute("data-pos")) for r in driver.find_elements("css selector", "#headstable tr.hrow")} == \
        set(trace.heads_for(t, top=12)["source"])
    shot(driver, "explore-heads.png")
    assert console_errors(driver) == []


@pytest.fixture(scope="module")
def compare_page(tiny_llama_dir, tmp_path_factory):
    from attngeom.cli import main

    out = tmp_path_factory.mktemp("cmp") / "cmp"
    assert main(["compare", "--model", str(tiny_llama_dir), "--text", "the cat sat on the mat",
                 "--text-b", "a cow sat on the mat", "--out", str(out)]) == 0
    return out / "compare.html"


def test_compare_page_side_by_side(driver, compare_page):
    """attngeom compare's page: two explorers; a token pinned in one shows its aligned token in the other.
    The test waits for the page to say it received the click (on a loaded machine, issue 52 read the
    position synced from the page's first view, 20, before the click's, 8, had arrived)."""
    driver.get(compare_page.resolve().as_uri())
    frames = driver.find_elements("tag name", "iframe")
    assert len(frames) == 2
    for f in frames:                                                  # both explorers are ready
        driver.switch_to.frame(f)
        wait_ready(driver)
        driver.switch_to.default_content()
    # the page is ready once it has heard from both explorers (their first positions are synced)
    assert wait_until(driver, "return document.body.dataset.ready", "the compare page to get ready") == "1"
    driver.switch_to.frame(frames[0])
    driver.find_element("css selector", '#tokens .tok[data-pos="10"]').click()    # "s" of "sat" in a
    driver.switch_to.default_content()
    wait_until(driver, 'return document.body.dataset.syncedFrom === "0:10"', "the click on position 10 of a to reach "
               "the compare page")
    assert driver.execute_script("return document.body.dataset.synced") == "8", what_the_page_shows(driver)  # "s" of "sat" in b
    driver.switch_to.frame(frames[1])
    wait_until(driver, """return document.querySelector('#tokens .tok[data-pos="8"]').classList.contains("query")""",
               "explorer b to show its position 8")
    driver.switch_to.default_content()
    shot(driver, "compare.png")
    assert console_errors(driver) == []
