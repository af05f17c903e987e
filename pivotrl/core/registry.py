"""Name → implementation registries for every choice a config string makes.

Used for advantage estimators, policy losses, KL estimators, verifiers and rollout engines.
Registering a name twice raises; looking up an unknown name lists the valid ones.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from pivotrl.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of implementations of one concept (e.g. ``"advantage estimator"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("grpo")``. Raises ValueError if ``name`` is taken."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """Return the implementation called ``name``; ConfigError listing valid names otherwise."""
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items)) or "(none registered)"
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
