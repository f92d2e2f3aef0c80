"""The pure parts of `nvpair plane create|get|patch`: FIELD=VALUE words, kinds, list answers."""

from __future__ import annotations

import pytest

from agent.cli.calls import CliError
from agent.cli.plane_objects import _items, body_of, kind_path


def test_field_words_are_json_when_they_parse_and_dotted_names_nest() -> None:
    words = ["name=acme", "maxDevices=8", 'spec.regions=["eu"]', "spec.residency=eu"]
    assert body_of([*words, 'label="123"', "host=null", "on=true"]) == {
        "name": "acme",
        "maxDevices": 8,
        "spec": {"regions": ["eu"], "residency": "eu"},
        "label": "123",
        "host": None,
        "on": True,
    }
    assert body_of(["url=s3://a/b=c"]) == {"url": "s3://a/b=c"}  # split at the first =
    for bad in (["name"], ["=x"], ["spec..a=1"], ["a=1", "a.b=2"]):
        with pytest.raises(CliError):
            body_of(bad)


def test_kinds_by_singular_or_plural_and_list_answers_of_any_shape() -> None:
    assert kind_path("policy") == kind_path("policies") == "/v1/policies"
    assert kind_path("priority-classes") == "/v1/priority-classes"
    with pytest.raises(CliError, match="unknown kind 'flavour'"):
        kind_path("flavour")
    row = {"id": "x"}
    assert _items({"items": [row], "next": "x"}) == [row]
    assert _items({"events": [row]}) == [row]
    assert _items([row]) == [row]
    assert _items({"id": "opr_x", "payload": {}, "history": [row]}) is None  # one object
