"""Name → function registries for the pieces a config picks by name (losses, estimators, rewards).

A typo in a config must fail at load time with the valid names, not deep inside a training step.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name that is not registered; the message lists the valid names and the closest match."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class Registry(Generic[T]):
    """A small mapping of names to implementations, filled with the `register` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` (names are unique)."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice.")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The entry called `name`; an unknown name raises UnknownNameError listing the valid ones."""
        if name not in self._entries:
            raise UnknownNameError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f" - did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}{hint} Valid: {', '.join(sorted(self._entries))}."

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
