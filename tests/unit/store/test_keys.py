"""Key encoding: every component becomes one safe path segment; bad keys get a clear error."""

from __future__ import annotations

import re

import pytest

from cairn.exceptions import ConfigError
from cairn.store.keys import MAX_COMPONENT_BYTES, Key, encode_component

SEGMENT = re.compile(r"^(~[0-9a-f]{48}|[A-Za-z0-9_%-][A-Za-z0-9_.%-]*)$")


@pytest.mark.parametrize(
    "component, encoded",
    [
        ("train", "train"),
        ("a/b", "a%2Fb"),
        ("scheduled__2026-01-01T00:00:00+00:00", "scheduled__2026-01-01T00%3A00%3A00%2B00%3A00"),
        ("ünï", "%C3%BCn%C3%AF"),
        ("..", "%2E."),
        (".hidden", "%2Ehidden"),
        ("a b~c", "a%20b%7Ec"),
        ("@log", "%40log"),
    ],
)
def test_components_are_percent_encoded(component: str, encoded: str) -> None:
    assert encode_component(component) == encoded
    assert SEGMENT.match(encoded)


def test_long_component_is_hashed_stably_and_distinctly() -> None:
    a = "x" * 1000
    b = "x" * 999 + "y"
    assert encode_component(a) == encode_component(a)
    assert encode_component(a) != encode_component(b)
    assert encode_component(a).startswith("~") and len(encode_component(a)) <= MAX_COMPONENT_BYTES
    # Just at the limit stays readable; one more escaped byte tips it over.
    assert encode_component("y" * 200) == "y" * 200
    assert encode_component("y" * 198 + "/").startswith("~")


def test_airflow_key_path() -> None:
    key = Key(("etl", "train", "manual__2026-11-29T10:00:00+00:00", "-1"))
    assert key.path == "etl/train/manual__2026-11-29T10%3A00%3A00%2B00%3A00/-1"
    assert all(SEGMENT.match(seg) for seg in key.path.split("/"))


def test_parse_splits_on_slash_and_decodes_escapes() -> None:
    assert Key.parse("dag/task/run%2Fwith%2Fslash/0").components == ("dag", "task", "run/with/slash", "0")
    assert str(Key(("a/b", "c"))) == "a%2Fb/c"
    assert Key.parse(str(Key(("a/b", "50%", "c")))) == Key(("a/b", "50%", "c"))


@pytest.mark.parametrize("bad", ["", "/", "a//b", None])
def test_bad_keys_name_the_fix(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        Key.parse(bad)  # type: ignore[arg-type]
    assert "key" in str(err.value)


def test_key_needs_a_tuple() -> None:
    with pytest.raises(ConfigError, match="Key.parse"):
        Key("dag/task")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least one"):
        Key(())


def test_lone_surrogate_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unicode"):
        Key(("bad\udc80",))
