"""Fast JSON output: read-only shared fragments and the spliced patch encoder."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.admission.encode import Fragment, encode_json, encode_patch

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                   st.text(max_size=6))
FRAGMENT = st.recursive(
    st.dictionaries(st.text(max_size=5), SCALAR, max_size=3).map(Fragment),
    lambda inner: st.dictionaries(st.text(max_size=5), st.one_of(SCALAR, inner),
                                  max_size=3).map(Fragment), max_leaves=6)
JSON = st.recursive(SCALAR, lambda x: st.lists(x, max_size=3)
                    | st.dictionaries(st.text(max_size=5), x, max_size=3), max_leaves=8)
OP = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from(["add", "replace", "test"]),
                           "path": st.text(max_size=12), "value": st.one_of(JSON, FRAGMENT)}),
    st.fixed_dictionaries({"op": st.just("remove"), "path": st.text(max_size=12)}),
    st.fixed_dictionaries({"op": st.just("move"), "from": st.text(max_size=5),
                           "path": st.text(max_size=5)}),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(OP, max_size=6))
def test_spliced_patch_is_the_same_json_as_the_plain_encoder(ops: list[dict[str, Any]]) -> None:
    text = encode_patch(ops)
    assert json.loads(text) == json.loads(encode_json(ops)) == ops


def test_fragments_are_read_only_and_copy_to_plain_dicts() -> None:
    inner = Fragment(fieldPath="metadata.uid")
    frag = Fragment(name="A", valueFrom=inner)
    assert frag.json == '{"name":"A","valueFrom":{"fieldPath":"metadata.uid"}}'
    for change in (lambda: frag.__setitem__("x", 1), lambda: frag.update(x=1),
                   lambda: frag.pop("name"), lambda: frag.clear(), lambda: frag.popitem(),
                   lambda: frag.setdefault("x", 1), lambda: frag.__delitem__("name")):
        with pytest.raises(TypeError):
            change()
    for clone in (copy.deepcopy(frag), copy.copy(frag), pickle.loads(pickle.dumps(frag))):
        assert clone == frag and type(clone) is dict
        clone["x"] = 1
    deep = copy.deepcopy(frag)
    assert type(deep["valueFrom"]) is dict
    with pytest.raises(TypeError):
        Fragment(a={"mutable": True})
    with pytest.raises(TypeError):
        Fragment(a=[1])


def test_fragments_compare_and_serialise_as_plain_mappings() -> None:
    frag = Fragment(name="A", value="1")
    assert frag == {"name": "A", "value": "1"}
    assert json.loads(json.dumps({"x": frag})) == {"x": {"name": "A", "value": "1"}}
    assert yaml.safe_load(yaml.dump(dict(frag), Dumper=yaml.SafeDumper)) == frag
