"""values.schema.json covers every value and rejects bad ones: `helm template` fails with a
message naming the value; cross-value mistakes fail in the templates with a message too."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuslice"


def _leaves(values: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(values, dict) and values:
        return [leaf for k, v in values.items() for leaf in _leaves(v, path + (k,))]
    return [path]


def _schema_node(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The schema of the value at ``path``; a free-form map covers everything below it."""
    node = schema
    for key in path:
        props = node.get("properties")
        if props is None and node.get("type") == "object":
            return node
        if props is None or key not in props:
            return None
        node = props[key]
    return node


def test_schema_declares_every_value_with_a_type_and_forbids_unknown_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for leaf in _leaves(values):
        node = _schema_node(schema, leaf)
        assert node is not None, f"values.schema.json does not declare {'.'.join(leaf)}"
        assert "type" in node, f"{'.'.join(leaf)} has no type in the schema"

    def closed(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} accepts unknown keys"
            for key, child in node["properties"].items():
                closed(child, f"{where}.{key}")

    closed(schema, "values")


@pytest.mark.parametrize(("values", "message"), [
    ({"splitCount": 0}, "/splitCount"),
    ({"splitCount": "ten"}, "/splitCount"),
    ({"namespaceMode": "everything"}, "/namespaceMode"),
    ({"defaultPolicy": "random"}, "/defaultPolicy"),
    ({"resourceNames": {"gpu": "gpu"}}, "/resourceNames/gpu"),
    ({"nodeLabel": {"value": True}}, "/nodeLabel/value"),
    ({"nodeLabel": {"key": "bad key"}}, "/nodeLabel/key"),
    ({"tls": {"mode": "none"}}, "/tls/mode"),
    ({"webhook": {"failurePolicy": "Maybe"}}, "/webhook/failurePolicy"),
    ({"webhook": {"timeoutSeconds": 31}}, "/webhook/timeoutSeconds"),
    ({"webhook": {"matchConditions": "yes"}}, "/webhook/matchConditions"),
    ({"webhook": {"replicaz": 2}}, "replicaz"),
    ({"webhook": {"excludedNamespaces": ["Not_A_Namespace"]}}, "/webhook/excludedNamespaces"),
    ({"gpuPods": {"tolerations": [{"operator": "Sometimes"}]}}, "/gpuPods/tolerations"),
    ({"gpuPods": {"runtimeClassName": "NVIDIA"}}, "/gpuPods/runtimeClassName"),
    ({"scheduler": {"extender": {"httpTimeout": "ten seconds"}}}, "/scheduler/extender"),
    ({"scheduler": {"name": ""}}, "/scheduler/name"),
    ({"agent": {"interval": 0}}, "/agent/interval"),
    ({"agent": {"audit": {"overLimitAction": "kill"}}}, "/agent/audit/overLimitAction"),
    ({"agent": {"audit": {"interval": -1}}}, "/agent/audit/interval"),
    ({"agent": {"audit": {"overLimitRounds": 0}}}, "/agent/audit/overLimitRounds"),
    ({"agent": {"audit": {"compute": {"window": 2}}}}, "/agent/audit/compute/window"),
    ({"agent": {"audit": {"compute": {"tolerancePercent": -1}}}},
     "/agent/audit/compute/tolerancePercent"),
    ({"agent": {"audit": {"compute": {"overLimitAction": "kill"}}}},
     "/agent/audit/compute/overLimitAction"),
    ({"agent": {"hostPID": "yes"}}, "/agent/hostPID"),
    ({"maxGpuMemoryMiB": -1}, "/maxGpuMemoryMiB"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"annotationGuard": {"enabled": "yes"}}, "/annotationGuard/enabled"),
    ({"podsWithoutGpus": {"hideGpus": "yes"}}, "/podsWithoutGpus/hideGpus"),
    ({"podsWithoutGpus": {"failurePolicy": "Maybe"}}, "/podsWithoutGpus/failurePolicy"),
    ({"annotationGuard": {"enable": True}}, "enable"),
    ({"surprise": 1}, "surprise"),
    # a digest goes in image.digest, not in the tag or the repository
    ({"webhook": {"image": {"tag": "0.1.0@sha256:" + "a" * 64}}}, "/webhook/image/tag"),
    ({"agent": {"image": {"repository": "ghcr.io/gpuslice/agent@sha256:" + "a" * 64}}},
     "/agent/image/repository"),
])
def test_schema_rejects_bad_values_naming_them(values: dict[str, Any], message: str,
                                               render_raw: Any) -> None:
    code, _, err = render_raw(values)
    assert code != 0
    assert "schema" in err and message in err, err


@pytest.mark.parametrize(("section", "digest"), [
    ("webhook", "sha256:abc"),  # too short
    ("scheduler", "sha256:" + "A" * 64),  # upper-case hex: registries write lower case
    ("agent", "@sha256:" + "a" * 64),  # the separator belongs to the rendering
    ("webhook", "sha512:" + "a" * 128),  # only sha256 digests are pinned
    ("scheduler", "a" * 64),  # no algorithm
    ("agent", "registry.k8s.io/pause@sha256:" + "a" * 64),  # a whole reference
])
def test_a_malformed_digest_is_refused_naming_the_field_and_the_form(
        section: str, digest: str, render_raw: Any) -> None:
    code, _, err = render_raw({section: {"image": {"digest": digest}}})
    assert code != 0
    assert "schema" in err and f"/{section}/image/digest" in err, err
    assert "sha256:[a-f0-9]{64}" in err, err


@pytest.mark.parametrize(("values", "kube_version", "message"), [
    ({"resourceNames": {"memory": "nvidia.com/gpu"}}, "1.30.0",
     "resourceNames: the four resource names must differ"),
    ({"tls": {"mode": "cert-manager", "certManager": {"issuerRef": {"kind": "ClusterIssuer"}}}},
     "1.30.0", "tls.certManager.issuerRef: needs a name"),
    ({"webhook": {"matchConditions": "enabled"}}, "1.25.0",
     "webhook.matchConditions=enabled needs Kubernetes >= 1.27"),
    # the kube-scheduler beside the webhook in one pod listens on 10259: one of them could not
    ({"webhook": {"port": 10259}}, "1.30.0", "webhook.port: 10259 is the kube-scheduler's own port"),
    # a bind answers within 8 s: a shorter timeout made the scheduler give up on binds that worked
    ({"scheduler": {"extender": {"httpTimeout": "1s"}}}, "1.30.0",
     "scheduler.extender.httpTimeout: 1s is too short"),
    ({"scheduler": {"extender": {"httpTimeout": "8999ms"}}}, "1.30.0",
     "scheduler.extender.httpTimeout: 8999ms is too short"),
    ({"fullnameOverride": "9lives"}, "1.30.0",
     'the object names would start "9lives", which Kubernetes refuses for a Service'),
])
def test_inconsistent_values_fail_with_a_message(values: dict[str, Any], kube_version: str,
                                                 message: str, render_raw: Any) -> None:
    code, _, err = render_raw(values, kube_version)
    assert code != 0
    assert message in err, err


def test_chart_refuses_kubernetes_older_than_1_25(render_raw: Any) -> None:
    code, _, err = render_raw({}, "1.24.9")
    assert code != 0 and "kubeVersion" in err, err


@pytest.mark.parametrize("timeout", ["9s", "9000ms", "0.15m", "1m30s", "1h"])
def test_extender_timeouts_of_9s_or_more_render(timeout: str, render_raw: Any) -> None:
    code, _, err = render_raw({"scheduler": {"extender": {"httpTimeout": timeout}}})
    assert code == 0, err


@pytest.mark.parametrize(("release", "prefix"), [
    ("my.release", "my-release-gpuslice"),  # Helm allows dots; a Service's name may not have one
    ("x" * 38 + "--y", "x" * 38),  # cut at 40 characters: every dash left at the end goes
])
def test_every_release_name_helm_accepts_gives_names_kubernetes_accepts(
        release: str, prefix: str, render_raw: Any, load_yaml: Any) -> None:
    code, out, err = render_raw({}, release=release)
    assert code == 0, err
    names = {o["metadata"]["name"] for o in load_yaml(out) if o["kind"] == "Service"}
    assert names and all(n.startswith(prefix) for n in names), names
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) for n in names), names


def test_a_release_name_with_a_digit_first_is_refused_with_what_to_do(render_raw: Any) -> None:
    code, _, err = render_raw({}, release="1gpu")
    assert code != 0
    assert "choose another release name or set fullnameOverride" in err, err
