"""How config fields are declared: a setting with its doc string, a nested section, a section of several kinds.

Each field is declared with `setting(default, doc)`, which keeps the field's documentation in
`dataclasses.Field.metadata["doc"]`. The loader uses it for error messages and `tools/config_reference.py`
turns it into `docs/configs.md`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with a default value and a one-line (or longer) doc string."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def section(cls: type, doc: str) -> Any:
    """A nested config section (a dataclass instance built with its defaults)."""
    return field(default_factory=cls, metadata={"doc": doc})


def field_doc(f: dataclasses.Field) -> str:
    """The doc string attached to a config field."""
    return f.metadata.get("doc", "")


class KindedSection:
    """A section whose settings depend on its `kind` (e.g. `model.attention`): the field is annotated with a
    subclass of this one, and each of that subclass's own subclasses is a dataclass holding one kind's settings,
    its first field `kind: Literal["name"] = setting("name", ...)`. The loader builds the one `kind` names."""

    @classmethod
    def kinds(cls) -> dict[str, type]:
        """The dataclass of each kind, by name."""
        return {sub.__dataclass_fields__["kind"].default: sub for sub in cls.__subclasses__()}
