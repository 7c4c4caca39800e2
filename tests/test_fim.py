"""FIM template detection for the main families."""

import pytest

from codecomplete.model.fim import TEMPLATES, detect_template


@pytest.mark.parametrize("name", ["starcoder", "qwen", "deepseek", "codellama"])
def test_each_family_is_detected_from_its_tokens(name):
    t = TEMPLATES[name]
    vocab = {t.prefix: 1, t.suffix: 2, t.middle: 3, "hello": 4}
    assert detect_template(vocab).name == name


def test_no_fim_tokens_means_prefix_only():
    assert detect_template({"hello": 1}).template is None


def test_override_needing_missing_tokens_is_refused_with_a_reason():
    vocab = set(TEMPLATES["qwen"].special_tokens)
    choice = detect_template(vocab, "starcoder")
    assert choice.name == "qwen" and "lacks" in choice.reason
    assert detect_template(vocab, "prefix-only").template is None


def test_psm_segments_put_specials_around_prefix_and_suffix():
    segs = TEMPLATES["starcoder"].psm_segments("def f(", "):")
    assert segs == [("<fim_prefix>", True), ("def f(", False), ("<fim_suffix>", True),
                    ("):", False), ("<fim_middle>", True)]
