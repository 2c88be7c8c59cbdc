"""YAML without silent surprises: a mapping that repeats a key is an error (PyYAML keeps the last
value without a word), reported as a YAMLError whose first line names the key and both lines."""

from __future__ import annotations

from typing import Any

import yaml
from dmd2_core.errors import DuplicateKeyError


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(f"duplicate key '{key}' (lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_unique(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys in any mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
