"""The JSON patch of a mutation: one structural diff of the received pod against the mutated one.

:func:`mutate_pod` shares every part of the pod it does not change with the received object
(copy on write). :func:`pod_patch` walks both documents together and skips every subtree that is
the *same object* in both, so its cost follows the size of the change, not of the pod (a real
pod with managedFields, probes and projected volumes is diffed in tens of microseconds, where
``jsonpatch.make_patch`` takes about a millisecond, most of the webhook's budget).

It is still one generic diff, never patch paths built by the mutation steps: RFC 6901 escaping
(``~0``, ``~1``) is applied to every key, absent parents are added whole, and the tests check
with ``jsonpatch.apply_patch`` that the patch turns the received object into the mutated one
(table cases and random documents).

Lists: the common head and tail (same object, or equal scalars) are kept; what is between is
diffed item by item when both sides have the same length, otherwise removed and added. That matches what the mutation does to lists (prepend env, append mounts and volumes,
drop reserved entries) with short patches.
"""

from __future__ import annotations

from typing import Any

Op = dict[str, Any]


def _escape(key: Any) -> str:
    text = key if isinstance(key, str) else str(key)
    if "~" in text or "/" in text:
        text = text.replace("~", "~0").replace("/", "~1")
    return text


def _same(a: Any, b: Any) -> bool:
    """Identical object, or the same JSON scalar (1, 1.0 and True differ in JSON)."""
    if a is b:
        return True
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return False
    return type(a) is type(b) and a == b


def _diff(a: Any, b: Any, path: str, ops: list[Op]) -> None:
    if a is b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a:
            if key not in b:
                ops.append({"op": "remove", "path": f"{path}/{_escape(key)}"})
        for key, value in b.items():
            if key not in a:
                ops.append({"op": "add", "path": f"{path}/{_escape(key)}", "value": value})
            elif a[key] is not value:
                _diff(a[key], value, f"{path}/{_escape(key)}", ops)
        return
    if isinstance(a, list) and isinstance(b, list):
        _diff_lists(a, b, path, ops)
        return
    if not _same(a, b):
        ops.append({"op": "replace", "path": path, "value": b})


def _diff_lists(a: list[Any], b: list[Any], path: str, ops: list[Op]) -> None:
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
            _diff(x, y, f"{path}/{head + i}", ops)
        return
    for i in range(head + len(old) - 1, head - 1, -1):
        ops.append({"op": "remove", "path": f"{path}/{i}"})
    for i, value in enumerate(new):
        ops.append({"op": "add", "path": f"{path}/{head + i}", "value": value})


def pod_patch(received: Any, mutated: Any) -> list[Op]:
    """The RFC 6902 operations that turn ``received`` into ``mutated`` (empty when equal)."""
    ops: list[Op] = []
    if isinstance(received, dict) and isinstance(mutated, dict) or isinstance(
            received, list) and isinstance(mutated, list):
        _diff(received, mutated, "", ops)
    elif not _same(received, mutated):
        ops.append({"op": "replace", "path": "", "value": mutated})
    return ops
