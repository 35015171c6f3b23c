"""Every command's ``--help`` states the defaults the command really uses, and those come from the
experiment's settings dataclass: the help text is parsed, not trusted."""

from __future__ import annotations

import argparse
import re

import pytest

from attngeom import cli

SETTINGS = {
    "analyze": ("attngeom.analysis.settings", "AnalyzeSettings", {}),
    "explore": ("attngeom.explorer.settings", "ExploreSettings", {}),
    "faithfulness": ("attngeom.faithfulness.settings", "FaithfulnessSettings", {}),
    "sinks": ("attngeom.sinks.settings", "SinksSettings", {}),
    "selection": ("attngeom.selection.settings", "SelectionSettings", {}),
    "heads": ("attngeom.heads.settings", "HeadsSettings", {}),
    "claims": ("attngeom.claims.settings", "ClaimsSettings", {"bootstrap": "n_resamples"}),
    "kvcache": ("attngeom.kvcache.settings", "KVCacheSettings", {}),
    "kvcache ": ("attngeom.kvcache.settings", "KVCacheInputs", {}),
}
STATED = re.compile(r"\(default:? ([^);]+?)(?:, |[;)]|$)")


def _parsers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _as_text(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_stated_defaults_are_the_real_ones(command):
    p = _parsers()[command]
    checked = 0
    for action in p._actions:
        if not action.help or action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            continue
        shown = action.help % {"default": action.default, "prog": p.prog} if "%(" in action.help else action.help
        m = STATED.search(shown)
        if m is None or not re.match(r"^[\w.,+-]+$", m.group(1).strip()):
            continue
        assert m.group(1).strip() == _as_text(action.default), (command, action.dest, shown, action.default)
        checked += 1
    assert checked >= 1, f"{command}: no option states its default"


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_defaults_come_from_the_settings_dataclass(command):
    import importlib

    module, name, renamed = SETTINGS[command]
    defaults = getattr(importlib.import_module(module), name)()
    p = _parsers()[command.strip()]
    compared = []
    for action in p._actions:
        field = renamed.get(action.dest, action.dest)
        if not hasattr(defaults, field) or action.default is None or field in ("layers", "heads"):
            continue
        want = getattr(defaults, field)
        got = action.default
        if isinstance(want, tuple):
            got = tuple(type(want[0])(x) if not isinstance(want[0], str) else x.strip()
                        for x in str(got).split(",")) if want else ()
        assert got == want, (command, action.dest, got, want)
        compared.append(field)
    assert compared, f"{command}: no option compared with {name}"


def test_claims_help_shows_its_real_window_defaults(capsys):
    from attngeom.claims.settings import ClaimsSettings

    with pytest.raises(SystemExit):
        cli.main(["claims", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    d = ClaimsSettings()
    assert f"BOS included (default {d.window})" in text
    assert f"windows to use (default {d.max_windows})" in text
