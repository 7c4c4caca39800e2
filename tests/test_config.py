"""Typed configuration: layering, validation, fallbacks."""

import dataclasses

from codecomplete.daemon.config import Config, SpeculationConfig, editor_settings, engine_settings, load_config, merge
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
