"""Changing one value deep inside a nested dict (a config, a figures document) to build a test's bad input."""

from __future__ import annotations

from collections.abc import Sequence


def change_at(data: dict, keys: Sequence[str], value, delete_marker) -> None:
    """Sets ``data[keys[0]]...[keys[-1]] = value`` in place; deletes that last key when ``value is
    delete_marker``."""
    *parents, last = keys
    node = data
    for key in parents:
        node = node[key]
    if value is delete_marker:
        del node[last]
    else:
        node[last] = value
