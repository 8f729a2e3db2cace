"""Named things of one kind, their options, and the discovery that registers a package's methods.

Defenses (privacy), attacks (attacks), pruning policies (pruning.policies), model profiles
(vlm.profiles, pruning.profiles) and paradigms (vlm.paradigms) are each one `Registry`:

    DEFENSES = Registry("defense", check=check_defense)
    DEFENSES.register(GaussianNoise)        # at the end of privacy/noise.py
    DEFENSES.get("noise"); DEFENSES.names(); [d for d in DEFENSES if d.stage == EDGE]

A package whose modules register its methods ends its __init__ with `import_modules(__name__)`:
a module added to the package is registered by being there, with no list to extend.

A method's `Options` is a dataclass that owns its defaults (a comment above each says what it
does) and checks them: `validate()` raises `OptionError` naming the option, the value and what
is allowed, which the run config reports under the option's key.
"""

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, replace
from typing import Any, Generic, Protocol, TypeVar


class Named(Protocol):
    name: str


class OptionError(ValueError):
    """A method option that is not allowed: names the option, the value and what is allowed."""

    def __init__(self, option: str, value: Any, allowed: str) -> None:
        self.option, self.value, self.allowed = option, value, allowed
        super().__init__(f"{option}={value!r} is not allowed; allowed: {allowed}")


class Configurable(Protocol):
    name: str
    Options: type


def check_names_an_option(kind: str, method: Configurable, attribute: str) -> None:
    """Refuse a method whose `attribute` (a defense's strength, a policy's budget) is neither None
    nor one of its options."""
    value, options = getattr(method, attribute), sorted(f.name for f in fields(method.Options))
    if value is not None and value not in options:
        raise ValueError(f"{kind} {method.name!r}: {attribute}={value!r}; allowed: None or an option of "
                         f"{method.Options.__name__}: {', '.join(options)}")


def options_from(method: Configurable, values: Mapping[str, Any]) -> Any:
    """The method's Options from a mapping of option values (unknown names refused)."""
    allowed = {f.name for f in fields(method.Options)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise OptionError(unknown[0], values[unknown[0]], f"an option of {method.name}: {', '.join(sorted(allowed))}")
    return replace(method.Options(), **values)


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Things of one kind by their `name`, in the order they were registered.

    `check` refuses, by raising, a thing that does not describe itself as its kind must
    (a defense's stage, an attack's headline metrics)."""

    def __init__(self, kind: str, *, check: Callable[[T], None] | None = None) -> None:
        self.kind = kind
        self._check = check
        self._items: dict[str, T] = {}

    def register(self, item: T, *, replace: bool = False) -> T:
        """Make `item` available by its name; refuses to shadow another unless `replace`."""
        if item.name in self._items and not replace:
            raise ValueError(f"a {self.kind} named {item.name!r} is already registered; "
                             "pass replace=True to redefine it")
        if self._check is not None:
            self._check(item)
        self._items[item.name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"no {self.kind} named {name!r}; registered: {', '.join(self._items)}") from None

    def names(self) -> list[str]:
        return list(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)


def import_modules(package: str) -> list[str]:
    """Import every module of `package` (not its `__main__`), in name order, so that each
    registers what it defines; the modules' full names."""
    path = importlib.import_module(package).__path__
    names = [f"{package}.{info.name}" for info in pkgutil.iter_modules(path) if info.name != "__main__"]
    for name in names:
        importlib.import_module(name)
    return names
