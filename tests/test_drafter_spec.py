"""The drafter-name grammar: one parser, its help and errors made from one table."""

from __future__ import annotations

import pytest

from dspark_edge.drafters import spec
from dspark_edge.errors import ConfigError


@pytest.mark.parametrize("text, kind, option, own", [
    ("none", "none", None, False), (None, "none", None, False), ("auto", "auto", None, True),
    ("ngram", "ngram", "table", False), ("ngram:online", "ngram", "online", False),
    ("ngram:prompt", "ngram", "prompt", False), ("self", "self", None, True), ("self:fp16", "self", "fp16", True),
    ("ngram+self", "ngram+self", None, True), ("ngram+self:int8", "ngram+self", "int8", True),
    ("dspark", "dspark", None, True), ("dspark:int8", "dspark", "int8", True),
    ("ngram+dspark", "ngram+dspark", None, True), ("ngram+dspark+self", "ngram+dspark+self", None, True),
    ("ngram+dspark+self:fp16", "ngram+dspark+self", "fp16", True),
])
def test_every_form_parses_and_prints_back(text, kind, option, own):
    s = spec.parse(text)
    assert (s.kind, s.option, s.own_model) == (kind, option, own)
    assert str(s) == (text or "none")
    assert s.self_drafting == (kind in ("self", "ngram+self", "ngram+dspark+self"))


def test_a_folder_is_a_draft_model_and_objects_run_no_graph(tmp_path):
    s = spec.parse(tmp_path)
    assert s.kind == "draft_model" and s.option == str(tmp_path) and s.own_model
    assert spec.own_model(str(tmp_path)) and not spec.own_model(object()) and not spec.own_model("ngram")


@pytest.mark.parametrize("text, what", [
    ("ngram:fast", "':online' or ':prompt'"), ("self:int3", "not a precision"), ("dspark:", "not a precision"),
    ("banana", "not one of"), ("", "not a drafter name"), ("auto:x", "not one of"),
])
def test_bad_names_list_the_grammar(text, what):
    with pytest.raises(ConfigError, match=what) as err:
        spec.parse(text)
    if "not one of" in what:
        assert spec.grammar() in str(err.value) and "auto" in str(err.value)


def test_help_is_made_from_the_table():
    for form, meaning in spec.KINDS.values():
        assert form in spec.grammar() and meaning in spec.describe()
