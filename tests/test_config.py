"""Typed configuration: layering, validation, fallbacks."""

import argparse
import dataclasses

import pytest

from codecomplete.daemon.cli import _common, cli_settings
from codecomplete.daemon.config import (Config, SpeculationConfig, editor_settings, engine_settings, load_config, merge,
                                       parse_set)
from codecomplete.model.api import SpecSettings


def test_invalid_values_keep_the_default_and_warn():
    warnings: list[str] = []
    cfg = merge(Config(), {"completion": {"mode": "sideways", "max_tokens": "many", "debounce_ms": -5},
                           "model": {"dtype": 3}}, "test", warnings)
    assert cfg == Config()
    assert len(warnings) == 4 and all(w.startswith("test: invalid") for w in warnings)


def test_camel_case_editor_keys_and_unknown_keys():
    warnings: list[str] = []
    cfg = merge(Config(), editor_settings({"codecomplete": {"completion": {"maxTokens": 9}, "colour": "red"}}),
                "editor", warnings)
    assert cfg.completion.max_tokens == 9
    assert warnings == ["editor: unknown setting 'colour' ignored"]


def test_a_section_that_is_not_a_table_is_reported():
    warnings: list[str] = []
    assert merge(Config(), {"completion": 5}, "x", warnings) == Config()
    assert warnings == ["x: completion must be a table, got int; keeping it as it was"]


def test_layers_user_then_repo_then_command_line(tmp_path):
    user = tmp_path / "user.toml"
    user.write_text('[completion]\nmax_tokens = 10\nmode = "multi"\n[model]\ndtype = "float32"\n')
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".codecomplete.toml").write_text('[completion]\nmax_tokens = 20\n')
    cfg, warnings = load_config(repo, {"model": {"dtype": "bfloat16"}}, user_file=user)
    assert warnings == []
    assert (cfg.completion.max_tokens, cfg.completion.mode, cfg.model.dtype) == (20, "multi", "bfloat16")
    assert engine_settings(cfg).dtype == "bfloat16"


def test_broken_config_file_is_reported_not_fatal(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[completion\nmax_tokens = ")
    cfg, warnings = load_config(None, None, user_file=bad)
    assert cfg == Config() and "unreadable config file" in warnings[0]


def test_a_config_file_named_but_missing_is_reported(tmp_path):
    """Guards --config with a typo: the defaults, and a warning saying why."""
    cfg, warnings = load_config(tmp_path, None, user_file=tmp_path / "typo.toml")
    assert cfg == Config() and warnings == [f"{tmp_path / 'typo.toml'}: config file not found; using the defaults"]


def test_empty_editor_section_means_no_settings():
    """Neovim encodes an empty Lua table as []."""
    assert editor_settings({"codecomplete": []}) == {}
    assert editor_settings({"completion": {"mode": "single"}}) == {"completion": {"mode": "single"}}


def test_early_exit_section_reaches_the_engine():
    warnings: list[str] = []
    cfg = merge(Config(), {"early_exit": {"enabled": True, "measure": "cosine", "lossless": True,
                                          "draftTokens": 6, "batch_rule": "sometimes", "maxBatch": 4}}, "x", warnings)
    es = engine_settings(cfg).early_exit
    assert es.enabled and es.measure == "cosine" and es.lossless and es.draft_tokens == 6 and es.max_batch == 4
    assert es.batch_rule == "all" and len(warnings) == 1 and "batch_rule" in warnings[0]
    assert not engine_settings(Config()).early_exit.enabled  # off by default


def test_the_weights_setting_reaches_the_engine_and_only_takes_what_it_can_run():
    warnings: list[str] = []
    assert engine_settings(Config()).weights == "bf16"  # the checkpoint's numbers unless asked
    cfg = merge(Config(), {"model": {"weights": "int8"}}, "x", warnings)
    assert engine_settings(cfg).weights == "int8" and warnings == []
    cfg = merge(cfg, {"model": {"weights": "int4"}}, "y", warnings)
    assert engine_settings(cfg).weights == "int8"
    assert len(warnings) == 1 and warnings[0].startswith("y: invalid") and "weights" in warnings[0]


def test_every_speculation_setting_reaches_the_engine_with_the_engines_defaults():
    """Guards against a setting the config offers but the engine never gets (live_chain was
    missing), and against the two sets of defaults drifting apart."""
    defaults = SpecSettings()
    for f in dataclasses.fields(SpeculationConfig):
        assert getattr(SpeculationConfig(), f.name) == getattr(defaults, f.name), f.name
    warnings: list[str] = []
    cfg = merge(Config(), editor_settings({"codecomplete": {"speculation": {"liveChain": 0, "maxNodes": 2}}}),
                "editor", warnings)
    spec = engine_settings(cfg).speculation
    assert warnings == [] and spec.live_chain == 0 and spec.max_nodes == 2


def test_set_flags_are_read_as_a_config_mapping():
    """Guards --set's reading: sections by dots, VALUE as JSON (numbers, booleans, lists) else a
    string, a top-level key without a section, the last of one key wins."""
    assert parse_set(["completion.max_tokens=32", "completion.mode=single", "log_level=debug",
                      "completion.disabled_languages=[\"markdown\", \"plaintext\"]", "speculation.enabled=false",
                      "model.name=/models/my model", "completion.max_tokens=16", "completion.context=a=b"]) == {
        "completion": {"max_tokens": 16, "mode": "single", "disabled_languages": ["markdown", "plaintext"],
                       "context": "a=b"},
        "log_level": "debug", "speculation": {"enabled": False}, "model": {"name": "/models/my model"}}
    for bad in ["completion.max_tokens", "=3", "completion.=3", ".x=1", "a..b=1"]:
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_set([bad])
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        parse_set(["log_level=debug"], section=True)
    with pytest.raises(ValueError, match="not a section"):
        parse_set(["completion=1", "completion.mode=single"])
    with pytest.raises(ValueError, match="is a section"):
        parse_set(["completion.mode=single", "completion=1"])


def test_set_flags_win_over_every_file_and_the_named_flags_win_over_them(tmp_path):
    """Guards the daemon's --set: over the user and repository files (and, in the server, the
    editor's settings: the command line is merged last there too); --model/--dtype over a --set of
    the same key; its keys and values checked as any source's (a warning, the rest kept); a
    malformed one refused by the parser."""
    p = argparse.ArgumentParser()
    _common(p)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".codecomplete.toml").write_text("[completion]\nmax_tokens = 20\nfirst_lines_ms = 300\n")
    args = p.parse_args(["--repo", str(repo), "--dtype", "float32", "--set", "completion.max_tokens=8",
                         "--set", "model.dtype=bfloat16", "--set", "model.device=cpu", "--set", "completion.nope=1",
                         "--set", "completion.mode=sideways", "--set", "completion.first_lines_ms=0"])
    settings = cli_settings(args)
    assert settings["model"] == {"dtype": "float32", "device": "cpu"}
    cfg, warnings = load_config(repo, settings, user_file=tmp_path / "none.toml")
    assert (cfg.completion.max_tokens, cfg.completion.first_lines_ms, cfg.model.dtype, cfg.model.device,
            cfg.completion.mode) == (8, 0, "float32", "cpu", "auto")
    assert "command line: unknown setting 'completion.nope' ignored" in warnings
    assert any(w.startswith("command line: invalid completion.mode") for w in warnings)
    editor = merge(merge(cfg, editor_settings({"codecomplete": {"completion": {"maxTokens": 40}}}), "editor", []),
                   settings, "command line", [])
    assert editor.completion.max_tokens == 8
    for bad in (["--set", "completion.max_tokens"], ["--set", "completion=1", "--set", "completion.mode=single"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert p.parse_args(["--set", "log_level=debug"]).set == ["log_level=debug"]
    assert p.parse_args([]).set == []
