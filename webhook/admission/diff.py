"""The JSON patch of a mutation: one structural diff of the received pod against the mutated one.

:func:`mutate_pod` shares every part of the pod it does not change with the received object
(copy on write). :func:`patch_json` walks both documents together and skips every subtree that
is the *same object* in both, so its cost follows the size of the change, not of the pod (a
real pod with managedFields, probes and projected volumes is diffed in tens of microseconds,
where ``jsonpatch.make_patch`` takes about a millisecond, most of the webhook's budget). It
writes the patch's compact JSON as it goes, splicing in the text each shared
:class:`~webhook.admission.encode.Fragment` carries, instead of building operation dicts for
an encoder to walk again; :func:`pod_patch` is the same patch as operations.

It is still one generic diff, never patch paths built by the mutation steps: RFC 6901 escaping
(``~0``, ``~1``) is applied to every key, absent parents are added whole, and the tests check
with ``jsonpatch.apply_patch`` that the patch turns the received object into the mutated one
(table cases and random documents), and that its text is what ``encode_json`` writes.

Lists: the common head and tail (same object, or equal scalars) are kept; what is between is
diffed item by item when both sides have the same length, otherwise removed and added. That matches what the mutation does to lists (prepend env, append mounts and volumes,
drop reserved entries) with short patches.
"""

from __future__ import annotations

import json
from typing import Any

from webhook.admission.encode import Fragment, encode_json

Op = dict[str, Any]
_MISSING = object()


def _key_text(key: Any) -> str:
    """A key as one RFC 6901 segment (``~0``, ``~1``), written as it goes inside a JSON string."""
    text = _KEY_TEXTS.get(key) if type(key) is str else None
    if text is not None:
        return text
    text = key if isinstance(key, str) else str(key)
    if "~" in text or "/" in text:
        text = text.replace("~", "~0").replace("/", "~1")
    if not (text.isascii() and text.isprintable() and '"' not in text and "\\" not in text):
        text = encode_json(text)[1:-1]
    if len(_KEY_TEXTS) < _KEY_TEXTS_MAX and type(key) is str and len(key) <= 64:
        _KEY_TEXTS[key] = text
    return text


# The keys of pods repeat (spec, containers, env, annotation names): their segments are
# remembered, up to a bound (keys are the client's, so the memo must not grow without one).
_KEY_TEXTS: dict[str, str] = {}
_KEY_TEXTS_MAX = 4096


def _value_text(value: Any) -> str:
    return value.json if type(value) is Fragment else encode_json(value)


def _same(a: Any, b: Any) -> bool:
    """Identical object, or the same JSON scalar (1, 1.0 and True differ in JSON)."""
    if a is b:
        return True
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return False
    return type(a) is type(b) and a == b


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Append the operations turning ``a`` into ``b`` at ``path`` (JSON-escaped) to ``out``."""
    if isinstance(a, dict) and isinstance(b, dict):
        if not a.keys() <= b.keys():
            for key in a:
                if key not in b:
                    out.append(f'{{"op":"remove","path":"{path}/{_key_text(key)}"}}')
        for key, value in b.items():
            old = a.get(key, _MISSING)
            if old is value:
                continue
            segment = _KEY_TEXTS.get(key) or _key_text(key)
            if old is _MISSING:
                text = value.json if type(value) is Fragment else encode_json(value)
                out.append(f'{{"op":"add","path":"{path}/{segment}","value":{text}}}')
            else:
                _diff(old, value, f"{path}/{segment}", out)
        return
    if isinstance(a, list) and isinstance(b, list):
        _diff_lists(a, b, path, out)
        return
    if not _same(a, b):
        out.append(f'{{"op":"replace","path":"{path}","value":{_value_text(b)}}}')


def _diff_lists(a: list[Any], b: list[Any], path: str, out: list[str]) -> None:
    head = 0
    shorter = min(len(a), len(b))
    while head < shorter and (a[head] is b[head] or _same(a[head], b[head])):
        head += 1
    tail = 0
    while tail < shorter - head and (a[-1 - tail] is b[-1 - tail]
                                     or _same(a[-1 - tail], b[-1 - tail])):
        tail += 1
    old, new = a[head:len(a) - tail], b[head:len(b) - tail]
    if len(old) == len(new):
        for i, (x, y) in enumerate(zip(old, new)):
            if x is not y:
                _diff(x, y, f"{path}/{head + i}", out)
        return
    for i in range(head + len(old) - 1, head - 1, -1):
        out.append(f'{{"op":"remove","path":"{path}/{i}"}}')
    for i, value in enumerate(new, head):
        text = value.json if type(value) is Fragment else encode_json(value)
        out.append(f'{{"op":"add","path":"{path}/{i}","value":{text}}}')


def patch_json(received: Any, mutated: Any) -> str:
    """The RFC 6902 patch turning ``received`` into ``mutated`` as compact JSON (``[]`` when
    equal), written while diffing: fragments' own text is spliced in (the text ``encode_json``
    writes for the operations, without building them first)."""
    out: list[str] = []
    if isinstance(received, dict) and isinstance(mutated, dict) or isinstance(
            received, list) and isinstance(mutated, list):
        if received is not mutated:
            _diff(received, mutated, "", out)
    elif not _same(received, mutated):
        out.append(f'{{"op":"replace","path":"","value":{_value_text(mutated)}}}')
    return "[" + ",".join(out) + "]"


def pod_patch(received: Any, mutated: Any) -> list[Op]:
    """The RFC 6902 operations that turn ``received`` into ``mutated`` (empty when equal)."""
    ops: list[Op] = json.loads(patch_json(received, mutated))
    return ops
