"""A choice that is a plain string in the YAML and on the wire and a member in the code: a
member prints and formats as its value (in messages, start-up lines and metrics labels),
msgspec and pydantic encode it as that string and refuse any other."""

from __future__ import annotations

from enum import Enum


class WireEnum(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
