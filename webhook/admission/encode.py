"""Serialising what the webhook sends: compact JSON, shared read-only fragments, the patch.

Every GPU container gets the same few env entries, mounts and volumes (per container name and
request). :func:`mutate_pod` builds them once as :class:`Fragment` objects, read-only dicts
that carry their own JSON text, and shares them between results. The diff
(:func:`~webhook.admission.diff.patch_json`) and :func:`encode_patch` then write a patch by
splicing those texts instead of encoding every nested dict again: the patch is most of an
answer, and this halves the cost of producing it. The output is plain JSON, equal to
``encode_json(ops)`` (tests check it against random patches).
"""

from __future__ import annotations

import copy
import json
from typing import Any, NoReturn

# Trees built here or by json.loads have no cycles to look for.
encode_json = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode

_SIMPLE_OPS = {"add", "remove", "replace", "test"}


class Fragment(dict[str, Any]):
    """A read-only dict whose compact JSON is computed once (``.json``).

    Values must be JSON scalars or other fragments, so the whole tree is read-only. Copies
    (``dict(f)``, ``copy.copy``, ``copy.deepcopy``) are ordinary, writable dicts.
    """

    __slots__ = ("json",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for value in self.values():
            if isinstance(value, (dict, list)) and not isinstance(value, Fragment):
                raise TypeError("fragment values must be scalars or fragments")
        self.json: str = encode_json(self)

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("gpuslice fragments are shared and read-only; copy with dict() first")

    __setitem__ = __delitem__ = _read_only
    update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]
    __ior__ = _read_only  # type: ignore[assignment]

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def _string(text: str) -> str:
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return encode_json(text)


def encode_patch(ops: list[dict[str, Any]]) -> str:
    """Compact JSON of a list of JSON-patch operations, splicing fragment texts."""
    parts: list[str] = []
    append = parts.append
    for op in ops:
        name, path = op.get("op"), op.get("path")
        size = len(op)
        if name not in _SIMPLE_OPS or type(path) is not str or not (
                size == 3 and "value" in op or size == 2):
            append(encode_json(op))
        elif size == 2:
            append(f'{{"op":"{name}","path":{_string(path)}}}')
        else:
            value = op["value"]
            text = value.json if type(value) is Fragment else encode_json(value)
            append(f'{{"op":"{name}","path":{_string(path)},"value":{text}}}')
    return "[" + ",".join(parts) + "]"
