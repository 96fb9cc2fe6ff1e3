"""Parser classes by name, for the server's `--tool-call-parser` and `--reasoning-parser`
(`ember.serve.tool_parsers`, `ember.serve.reasoning_parsers`): adding a parser is one class
with a `name` and this decorator."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes registered under their `name`. `kind` names them in errors ("tool parser"),
    `option` is the setting that picks one ("tool_call_parser")."""

    def __init__(self, kind: str, option: str) -> None:
        self.kind, self.option = kind, option
        self.classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: adds `cls` under `cls.name` (a non-empty string, not taken by
        another class)."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} class {cls.__name__} needs a non-empty string `name`")
        if self.classes.get(name, cls) is not cls:
            raise ValueError(
                f"{self.kind} name {name!r} is already registered by {self.classes[name].__name__}"
            )
        self.classes[name] = cls
        return cls

    def get(self, name: str) -> T:
        """The class registered as `name`; a ValueError naming the known ones otherwise."""
        try:
            return self.classes[name]
        except KeyError:
            known = ", ".join(sorted(self.classes))
            raise ValueError(f"unknown {self.option} {name!r}; known parsers: {known}") from None
