"""Named registries for the extension points of the estimator library.

One registry per extension point (advantage estimator, policy loss, off-policy weight). A name can be
registered once; looking up an unknown name raises an error that lists the valid names and suggests the
nearest one, so a typo in a config file is caught with a useful message.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=Callable)


class RegistryError(KeyError):
    """An unknown or duplicate name in a registry."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A name → callable table with duplicate rejection and helpful lookup errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@ADVANTAGES.register("gae")``. Registering a name twice is an error."""

        def decorate(fn: T) -> T:
            if name in self._entries:
                raise RegistryError(f"{self.kind} '{name}' is already registered; pick another name")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise RegistryError(unknown_name_message(self.kind, name, self.names()))
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    """"unknown advantage estimator 'gea'; did you mean 'gae'? Valid: a, b, c"."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {kind} '{name}'{hint} Valid names: {', '.join(valid)}"
