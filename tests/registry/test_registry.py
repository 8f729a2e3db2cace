"""The one registry helper: registration, lookup with the known names, order, checks, and discovery."""

import sys
import textwrap
from dataclasses import dataclass

import pytest

from registry import OptionError, Registry, import_modules, options_from


@dataclass(frozen=True)
class Thing:
    name: str
    size: int = 0


def test_things_are_found_by_name_and_listed_in_registration_order():
    things = Registry("thing")
    small, big = things.register(Thing("small", 1)), things.register(Thing("big", 9))
    assert things.get("big") is big and things.names() == ["small", "big"]
    assert list(things) == [small, big] and len(things) == 2
    assert "small" in things and "huge" not in things


def test_an_unknown_name_is_refused_naming_the_known_ones():
    things = Registry("thing")
    things.register(Thing("small"))
    things.register(Thing("big"))
    with pytest.raises(ValueError, match="no thing named 'huge'; registered: small, big"):
        things.get("huge")


def test_a_second_thing_of_one_name_needs_replace():
    things = Registry("thing")
    things.register(Thing("small", 1))
    with pytest.raises(ValueError, match="a thing named 'small' is already registered; pass replace=True"):
        things.register(Thing("small", 2))
    things.register(Thing("small", 2), replace=True)
    assert things.get("small").size == 2 and things.names() == ["small"]


def test_the_check_refuses_what_does_not_describe_itself():
    def positive(thing: Thing) -> None:
        if thing.size <= 0:
            raise ValueError(f"{thing.name}: size must be > 0")

    things = Registry("thing", check=positive)
    with pytest.raises(ValueError, match="empty: size must be > 0"):
        things.register(Thing("empty"))
    assert things.names() == []


def test_iterating_a_registry_while_registering_sees_what_was_there():
    things = Registry("thing")
    things.register(Thing("a"))
    for thing in things:
        things.register(Thing(thing.name * 2))
    assert things.names() == ["a", "aa"]


@dataclass
class Knob:
    level: int = 1
    mode: str = "soft"


class Method:
    name = "method"
    Options = Knob


def test_options_come_from_a_mapping_of_their_names():
    assert options_from(Method, {"level": 3}) == Knob(level=3)
    assert options_from(Method, {}) == Knob()
    with pytest.raises(OptionError, match=r"lvl=3 is not allowed; allowed: an option of method: level, mode"):
        options_from(Method, {"lvl": 3})


def test_an_option_error_names_option_value_and_what_is_allowed():
    error = OptionError("level", -1, ">= 0")
    assert (error.option, error.value, error.allowed) == ("level", -1, ">= 0")
    assert str(error) == "level=-1 is not allowed; allowed: >= 0"


def test_a_module_added_to_a_package_is_registered_by_being_there(tmp_path, monkeypatch):
    """The package imports its modules in name order, each registering its thing; __main__ is
    never imported (running it is what `python -m package` does)."""
    package = tmp_path / "gadgets"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        from registry import Registry, import_modules
        GADGETS = Registry("gadget")
        MODULES = None

        def discover():
            global MODULES
            MODULES = import_modules(__name__)
    """))
    for name in ("lever", "gear"):
        (package / f"{name}.py").write_text(
            f"from dataclasses import dataclass\nfrom gadgets import GADGETS\n\n"
            f"@dataclass(frozen=True)\nclass Gadget:\n    name: str\n\nGADGETS.register(Gadget({name!r}))\n")
    (package / "__main__.py").write_text("raise SystemExit('__main__ must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import gadgets

        gadgets.discover()
        assert gadgets.MODULES == ["gadgets.gear", "gadgets.lever"]
        assert gadgets.GADGETS.names() == ["gear", "lever"]
    finally:
        for module in [m for m in sys.modules if m == "gadgets" or m.startswith("gadgets.")]:
            del sys.modules[module]
