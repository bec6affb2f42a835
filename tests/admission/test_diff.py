"""The mutation's JSON patch: applied to the received object it always gives the mutated one.

``pod_patch`` skips subtrees shared (same object) between the two documents, so the property
tests build the second document the way the mutation does: by copying along changed paths and
sharing the rest, then also check unrelated documents.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.admission.diff import patch_json, pod_patch
from webhook.admission.encode import Fragment, encode_json

KEYS = st.sampled_from(["a", "b", "x/y", "t~0", "~", "/", "", "env", "0", "metadata", "k~1/"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.5]),
                    st.text(max_size=4))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=25)


def _edit(doc: Any, data: st.DataObject, depth: int = 0) -> Any:
    """A copy-on-write edit of ``doc``: changed parts are new objects, the rest is shared."""
    choice = data.draw(st.integers(0, 4))
    if isinstance(doc, dict) and doc and choice < 3:
        new = dict(doc)
        key = data.draw(st.sampled_from(sorted(doc)))
        if choice == 0:
            del new[key]
        else:
            new[key] = _edit(doc[key], data, depth + 1)
        if data.draw(st.booleans()):
            new[data.draw(KEYS)] = data.draw(JSON)
        return new
    if isinstance(doc, list) and choice < 3:
        new_list = list(doc)
        op = data.draw(st.integers(0, 3))
        if op == 0 or not new_list:
            new_list.insert(data.draw(st.integers(0, len(new_list))), data.draw(JSON))
        elif op == 1:
            del new_list[data.draw(st.integers(0, len(new_list) - 1))]
        elif op == 2:
            i = data.draw(st.integers(0, len(new_list) - 1))
            new_list[i] = _edit(new_list[i], data, depth + 1)
        else:
            new_list = [data.draw(JSON)] * data.draw(st.integers(0, 2)) + new_list
        return new_list
    if choice == 3:
        return copy.deepcopy(doc)  # equal content, no sharing
    return data.draw(JSON)


def _check(a: Any, b: Any) -> None:
    before = copy.deepcopy(a)
    patch = json.loads(json.dumps(pod_patch(a, b)))
    assert a == before
    # The text written while diffing is the plain compact encoding of the same operations.
    text = patch_json(a, b)
    assert text == encode_json(json.loads(text)) and json.loads(text) == patch
    assert jsonpatch.apply_patch(a, patch) == b


@settings(max_examples=300, deadline=None)
@given(JSON, st.data())
def test_patch_of_copy_on_write_edit_rebuilds_the_result(doc: Any, data: st.DataObject) -> None:
    edited = doc
    for _ in range(data.draw(st.integers(1, 3))):
        edited = _edit(edited, data)
    _check(doc, edited)


@settings(max_examples=150, deadline=None)
@given(JSON, JSON)
def test_patch_between_unrelated_documents_rebuilds_the_second(a: Any, b: Any) -> None:
    _check(a, b)


def test_identical_objects_give_an_empty_patch() -> None:
    pod = {"metadata": {"annotations": {"a/b": "1"}}, "spec": {"containers": [{"name": "c"}]}}
    assert pod_patch(pod, pod) == []
    assert pod_patch(pod, copy.deepcopy(pod)) == []


def test_keys_with_slash_and_tilde_are_escaped() -> None:
    a = {"metadata": {"annotations": {"x": "1"}}}
    b = {"metadata": {"annotations": {"x": "1", "gpuslice.io/mutated": "v", "a~b": "c"}}}
    assert pod_patch(a, b) == [
        {"op": "add", "path": "/metadata/annotations/gpuslice.io~1mutated", "value": "v"},
        {"op": "add", "path": "/metadata/annotations/a~0b", "value": "c"},
    ]


def test_json_types_are_told_apart() -> None:
    assert pod_patch({"a": 1}, {"a": True}) == [{"op": "replace", "path": "/a", "value": True}]
    assert pod_patch([1], [1.0]) == [{"op": "replace", "path": "/0", "value": 1.0}]


def test_prepended_items_are_added_in_front_of_shared_ones() -> None:
    user = [{"name": "A"}, {"name": "B"}]
    ours = [{"name": "X"}]
    assert pod_patch({"env": user}, {"env": ours + user}) == [
        {"op": "add", "path": "/env/0", "value": {"name": "X"}}]


# Keys the API server may send that the written path must escape: JSON's own (quote,
# backslash, control characters, DEL), RFC 6901's (~, /), non-ASCII, non-BMP, lone surrogates
# (json.loads gives them for \ud800), and keys longer than the segment memo keeps. Only keys
# JSON can carry: a high surrogate before a low one is read back as one non-BMP character
# ("\ud800\udfff" -> "\U000103ff"), so json.loads never gives that pair.
def _from_json(text: str) -> bool:
    return bool(json.loads(json.dumps(text)) == text)


ODD_KEYS = st.one_of(
    st.text(alphabet=st.sampled_from('~/"\\\x00\x1f\x7f\ud800\udfff\U0001f600\u00e9a 0'),
            max_size=5).filter(_from_json),
    st.text(min_size=60, max_size=70, alphabet="ab~/\""), st.text(max_size=6))
ODD_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80),
                        st.floats(allow_nan=False), st.text(max_size=4))


def _fragments(d: dict[str, Any]) -> Any:
    return Fragment(d)


ODD_JSON = st.recursive(ODD_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(ODD_KEYS, inner, max_size=4),
    st.dictionaries(ODD_KEYS, ODD_SCALARS, max_size=3).map(_fragments)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(ODD_JSON, ODD_JSON)
def test_written_patch_escapes_odd_keys_and_values(a: Any, b: Any) -> None:
    """Each key's segment is escaped on its own and remembered: the text still parses to the
    operations that rebuild ``b`` and is their compact encoding, for every key and value."""
    for _ in range(2):  # the second time from the remembered segments
        text = patch_json(a, b)
        assert text == encode_json(json.loads(text))
        assert jsonpatch.apply_patch(a, json.loads(text)) == b
