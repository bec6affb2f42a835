"""The image reference of each of the chart's three images (webhook, kube-scheduler, agent):
repository:tag by default, as every release so far rendered it; pinned by digest when
``image.digest`` is set, as air-gapped and regulated clusters pin them. A digest with a tag the
operator set keeps the tag as the readable name (repository:tag@digest); a digest alone never
gets a default tag (appVersion, the cluster's version) it may not name. Malformed digests are
refused by values.schema.json (test_chart_values checks the messages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuslice"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
DIGEST = "sha256:" + "0123456789abcdef" * 4
OTHER_DIGEST = "sha256:" + "f" * 64

# values section -> (workload kind, workload name, container names that run the image)
IMAGES = {
    "webhook": ("Deployment", "gpuslice", [("webhook", False), ("tls-bootstrap", True)]),
    "scheduler": ("Deployment", "gpuslice", [("kube-scheduler", False)]),
    "agent": ("DaemonSet", "gpuslice-agent", [("agent", False)]),
}


def _images(rendered: Any, section: str) -> list[str]:
    """The image of every container that runs ``section``'s image."""
    kind, name, containers = IMAGES[section]
    workload = rendered.one(kind, name)
    return [rendered.container(workload, c, init=init)["image"] for c, init in containers]


def test_every_container_of_the_chart_is_checked(render: Any) -> None:
    """IMAGES names every container of every pod template the chart renders (the TLS
    bootstrap init container is there in the default secret mode, not with cert-manager)."""
    named = {(kind, name, c, init) for kind, name, cs in IMAGES.values() for c, init in cs}
    found = set()
    objects = render().objects + render({"tls": {"mode": "cert-manager"}}).objects
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for key, init in (("containers", False), ("initContainers", True)):
            for c in spec.get(key, []):
                found.add((obj["kind"], obj["metadata"]["name"], c["name"], init))
    assert found == named


def test_default_images_are_repository_colon_tag_without_a_digest(render: Any) -> None:
    rendered = render()
    assert _images(rendered, "webhook") == [f"ghcr.io/gpuslice/webhook:{APP_VERSION}"] * 2
    assert _images(rendered, "scheduler") == ["registry.k8s.io/kube-scheduler:v1.30.0"]
    assert _images(rendered, "agent") == [f"ghcr.io/gpuslice/agent:{APP_VERSION}"]


@pytest.mark.parametrize("section", list(IMAGES))
def test_a_digest_alone_pins_the_image_as_repository_at_digest(section: str,
                                                                render: Any) -> None:
    rendered = render({section: {"image": {"digest": DIGEST}}})
    repository = yaml.safe_load((CHART / "values.yaml").read_text())[section]["image"][
        "repository"]
    assert set(_images(rendered, section)) == {f"{repository}@{DIGEST}"}
    others = [s for s in IMAGES if s != section]
    assert all("@" not in image for s in others for image in _images(rendered, s))


@pytest.mark.parametrize("section", list(IMAGES))
def test_a_digest_with_a_tag_keeps_the_tag_as_the_readable_name(section: str,
                                                                 render: Any) -> None:
    rendered = render({section: {"image": {"repository": "mirror.example:5000/team/img",
                                           "tag": "v1.30.2", "digest": DIGEST}}})
    assert set(_images(rendered, section)) == {f"mirror.example:5000/team/img:v1.30.2@{DIGEST}"}


def test_each_image_takes_its_own_digest(render: Any) -> None:
    rendered = render({"webhook": {"image": {"digest": DIGEST}},
                       "scheduler": {"image": {"digest": OTHER_DIGEST, "tag": "v1.31.4"}},
                       "agent": {"image": {"digest": OTHER_DIGEST}}})
    assert set(_images(rendered, "webhook")) == {f"ghcr.io/gpuslice/webhook@{DIGEST}"}
    assert _images(rendered, "scheduler") == [
        f"registry.k8s.io/kube-scheduler:v1.31.4@{OTHER_DIGEST}"]
    assert _images(rendered, "agent") == [f"ghcr.io/gpuslice/agent@{OTHER_DIGEST}"]


@pytest.mark.parametrize("kube_version", ["1.25.0", "v1.31.4-eks-a737599"])
def test_a_scheduler_digest_without_a_tag_ignores_the_cluster_version(kube_version: str,
                                                                      render: Any) -> None:
    rendered = render({"scheduler": {"image": {"digest": DIGEST}}}, kube_version)
    assert _images(rendered, "scheduler") == [f"registry.k8s.io/kube-scheduler@{DIGEST}"]


def test_pull_policy_is_unchanged_by_a_digest(render: Any) -> None:
    rendered = render({s: {"image": {"digest": DIGEST, "pullPolicy": "Always"}} for s in IMAGES})
    for kind, name, containers in IMAGES.values():
        workload = rendered.one(kind, name)
        for c, init in containers:
            assert rendered.container(workload, c, init=init)["imagePullPolicy"] == "Always"
