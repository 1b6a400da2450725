"""A registry: the one place that lists the members of a kind of thing (fit class, head recipe, model family).

Params validation, dispatch, the report, the bench and the tests all iterate or look up a registry; no
other file lists the names, so adding a member is one module plus one line where its registry is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from lmgeo.core.errors import InputError


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class UnknownName(InputError):
    """A name that is not registered; the message lists the registered ones."""


class Registry(Generic[T]):
    """Members of one kind, by name, in registration order (the order reports and tables use)."""

    def __init__(self, kind: str, members: Iterable[T]) -> None:
        self.kind = kind
        self._members: dict[str, T] = {}
        for member in members:
            if member.name in self._members:
                raise ValueError(f"{kind} {member.name!r} is registered twice")
            self._members[member.name] = member

    def __getitem__(self, name: str) -> T:
        try:
            return self._members[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}; registered: {', '.join(self._members)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __iter__(self) -> Iterator[T]:
        return iter(self._members.values())

    def __len__(self) -> int:
        return len(self._members)

    def names(self) -> tuple[str, ...]:
        return tuple(self._members)

    def order(self, name: str) -> tuple[int, str]:
        """Sort key: registration order, unknown names last (alphabetically)."""
        names = self.names()
        return (names.index(name), name) if name in names else (len(names), name)
