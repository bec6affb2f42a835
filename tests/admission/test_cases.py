"""The table of mutation cases in cases/*.yaml: result, patch, idempotence, schema validity.

Each case names an input pod and optional ``settings``, ``namespace``, ``max_gpu_memory_mib``,
and expects exactly one of: ``expect`` (the mutated pod, ``$VERSION`` standing for the
webhook's version, plus ``warnings``), ``unchanged: true``, or ``denied`` (every message).
``since`` raises the oldest Kubernetes schema checked, for cases using newer pod fields.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from kubeschema import NEWEST, VERSIONS, assert_valid

from webhook import __version__, names
from webhook.admission.diff import pod_patch
from webhook.admission.mutate import mutate_pod
from webhook.settings import settings_from_mapping

CASES_DIR = Path(__file__).parent / "cases"
KEYS = {"name", "input", "settings", "namespace", "max_gpu_memory_mib", "expect", "warnings",
        "unchanged", "denied", "since"}


def _cases() -> list[Any]:
    params = []
    for path in sorted(CASES_DIR.glob("*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            params.append(pytest.param(case, id=f"{path.stem}: {case['name']}"))
    return params


CASES = _cases()


def _with_version(pod: dict[str, Any]) -> dict[str, Any]:
    """The expected pod with ``$VERSION`` resolved (a pod that requests no GPU, changed only
    by ``hide_gpus_from_pods_without_gpus``, carries no mark)."""
    pod = copy.deepcopy(pod)
    annotations = pod["metadata"].get("annotations")
    if annotations is None:
        return pod
    assert annotations[names.ANN_MUTATED] == "$VERSION"
    annotations[names.ANN_MUTATED] = __version__
    return pod


def test_case_table_covers_every_outcome() -> None:
    kinds = [("denied" in c.values[0], c.values[0].get("unchanged", False)) for c in CASES]
    assert kinds.count((True, False)) >= 15 and kinds.count((False, True)) >= 5
    assert kinds.count((False, False)) >= 20


@pytest.mark.parametrize("case", CASES)
def test_mutation_case(case: dict[str, Any]) -> None:
    assert set(case) <= KEYS, f"unknown keys {set(case) - KEYS}"
    assert sum(k in case for k in ("expect", "unchanged", "denied")) == 1
    settings = settings_from_mapping(case.get("settings") or {})
    pod = case["input"]
    received = copy.deepcopy(pod)
    kwargs = {"namespace": case.get("namespace"),
              "max_gpu_memory_mib": case.get("max_gpu_memory_mib")}

    result = mutate_pod(pod, settings, **kwargs)
    assert pod == received, "mutate_pod changed its input"

    if "denied" in case:
        assert not result.allowed and result.pod is None
        assert [str(d) for d in result.denials] == case["denied"]
        assert result.message == "; ".join(case["denied"])
        return
    assert result.allowed
    if case.get("unchanged"):
        assert not result.changed and result.pod is pod and result.warnings == ()
        return

    expected = _with_version(case["expect"])
    assert result.pod == expected
    assert list(result.warnings) == case.get("warnings", [])

    # The patch, as it travels (JSON), turns the received pod into the result.
    patch = json.loads(json.dumps(pod_patch(received, result.pod)))
    assert patch
    assert jsonpatch.apply_patch(received, patch) == expected

    # Mutating the result again changes nothing and warns about nothing.
    again = mutate_pod(result.pod, settings, **kwargs)
    assert again.allowed and again.pod == expected and again.warnings == ()
    assert pod_patch(result.pod, again.pod) == []

    # Cases using newer pod fields (``since: "1.29"``) validate from that version on.
    versions = (f"{case['since']}.0", NEWEST) if "since" in case else VERSIONS
    assert_valid(result.pod, versions)
