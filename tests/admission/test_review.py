"""The AdmissionReview envelope: request checks and the two ways a response is encoded."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.admission import review

PATCHES = st.one_of(st.none(), st.lists(st.fixed_dictionaries({
    "op": st.sampled_from(["add", "remove", "replace"]), "path": st.text(max_size=20),
    "value": st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text()),
                          lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(), x,
                                                                               max_size=3),
                          max_leaves=8)}), max_size=4))


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=60), PATCHES,
       st.one_of(st.none(), st.lists(st.text(max_size=30), max_size=3)))
def test_fast_allowed_encoding_equals_the_typed_response(uid: str, patch: Any,
                                                         warnings: Any) -> None:
    fast = review.encode_allowed(uid, patch, warnings)
    assert json.loads(fast) == json.loads(review.encode_json(review.allowed(uid, patch, warnings)))
    if patch:
        assert json.loads(base64.b64decode(json.loads(fast)["response"]["patch"])) == patch


def test_denial_carries_code_reason_and_message() -> None:
    assert review.denied("u", "fix it", ["w"]) == {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "response": {"uid": "u", "allowed": False, "warnings": ["w"],
                     "status": {"code": 403, "reason": "Forbidden", "message": "fix it"}}}


@pytest.mark.parametrize(("request_", "is_create"), [
    ({"operation": "CREATE", "kind": {"group": "", "version": "v1", "kind": "Pod"}}, True),
    ({"operation": "UPDATE", "kind": {"group": "", "version": "v1", "kind": "Pod"}}, False),
    ({"operation": "CREATE", "kind": {"group": "apps", "version": "v1", "kind": "Pod"}}, False),
    ({"operation": "CREATE", "kind": {"group": "", "version": "v1", "kind": "Binding"}}, False),
    ({"operation": "CREATE", "kind": {"group": "", "version": "v1", "kind": "Pod"},
      "subResource": "binding"}, False),
    # In-place resize (1.33+): the API server lets it change only cpu and memory.
    ({"operation": "UPDATE", "kind": {"group": "", "version": "v1", "kind": "Pod"},
      "subResource": "resize"}, False),
])
def test_only_the_create_of_a_pod_itself_is_mutated(request_: Any, is_create: bool) -> None:
    assert review.is_pod_create({"uid": "u", **request_}) is is_create  # type: ignore[typeddict-item]
    assert not review.is_ephemeral_update({"uid": "u", **request_})  # type: ignore[typeddict-item]
