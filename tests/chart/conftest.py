"""Rendering the chart with the real helm binary (``.tools/helm``, from ``scripts/setup.sh``).

``render(values, kube_version)`` runs ``helm template`` once per distinct input (cached) and
returns a :class:`Rendered` with the objects; ``helm_run(args)`` runs any helm command.

``helm template`` sees no cluster: its ``.Capabilities.APIVersions`` hold group/versions only, no
kinds. ``render`` therefore passes, as ``--api-versions``, the kinds the chart asks about that a
default-configured cluster of ``kube_version`` serves (:func:`served_api_versions`), so a render
shows what ``helm install`` on that cluster would create; ``api_versions=`` overrides them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpuslice"
RELEASE, NAMESPACE = "gpuslice", "gpuslice-system"

# ValidatingAdmissionPolicy (the annotation guard): v1 is GA and served by default from 1.30;
# v1beta1 exists in 1.28-1.29 but is served only with the feature gate and the beta API on.
VAP_V1 = ("admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
          "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding")
VAP_V1BETA1 = ("admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy",
               "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicyBinding")


def served_api_versions(kube_version: str) -> tuple[str, ...]:
    """The group/version/kind entries the chart checks that a default-configured cluster of
    ``kube_version`` ("1.30.0", "v1.29.3") serves."""
    major, minor = (int(p) for p in kube_version.lstrip("v").split(".")[:2])
    return VAP_V1 if (major, minor) >= (1, 30) else ()


def helm_binary() -> str | None:
    local = ROOT / ".tools" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("helm")


@dataclass
class Rendered:
    """The objects of one ``helm template`` run."""

    objects: list[dict[str, Any]]
    kube_version: str
    api_versions: tuple[str, ...] = ()

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    def container(self, workload: dict[str, Any], name: str,
                  init: bool = False) -> dict[str, Any]:
        spec = workload["spec"]["template"]["spec"]
        found = [c for c in spec.get("initContainers" if init else "containers", [])
                 if c["name"] == name]
        assert len(found) == 1, f"no container {name} in {workload['metadata']['name']}"
        return found[0]

    def config(self, configmap: str, key: str = "config.yaml") -> dict[str, Any]:
        [doc] = load_all(self.one("ConfigMap", configmap)["data"][key])
        return doc


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate mapping keys, as the API server's decoder does
    (PyYAML would silently keep the last one)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    duplicates = sorted({str(k) for k in keys if keys.count(k) > 1})
    if duplicates:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {duplicates}", node.start_mark)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(text: str) -> list[dict[str, Any]]:
    """The documents of ``text`` (empty ones dropped); duplicate keys are an error."""
    return [d for d in yaml.load_all(text, Loader=_StrictLoader) if d]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    binary = helm_binary()
    if binary is None:
        pytest.skip("helm not found: run `bash scripts/setup.sh` (puts it at .tools/helm)")
    env = {**os.environ, "HELM_CACHE_HOME": tempfile.gettempdir() + "/gpuslice-helm-cache",
           "HELM_CONFIG_HOME": tempfile.gettempdir() + "/gpuslice-helm-config",
           "HELM_DATA_HOME": tempfile.gettempdir() + "/gpuslice-helm-data"}
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60,
                          env=env, check=False)


@functools.cache
def _render_cached(values_json: str, kube_version: str, namespace: str, release: str,
                   api_versions: tuple[str, ...]) -> tuple[int, str, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(values_json)  # JSON is YAML
    try:
        proc = _run(["template", release, str(CHART), "--namespace", namespace,
                     "--kube-version", kube_version, "-f", f.name,
                     *(arg for v in api_versions for arg in ("--api-versions", v))])
    finally:
        os.unlink(f.name)
    return proc.returncode, proc.stdout, proc.stderr


def render_raw(values: dict[str, Any] | None = None, kube_version: str = "1.30.0",
               namespace: str = NAMESPACE, release: str = RELEASE,
               api_versions: tuple[str, ...] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``helm template`` with ``values``; ``api_versions``
    defaults to :func:`served_api_versions` of ``kube_version``."""
    if api_versions is None:
        api_versions = served_api_versions(kube_version)
    return _render_cached(json.dumps(values or {}, sort_keys=True), kube_version, namespace,
                          release, tuple(api_versions))


def render(values: dict[str, Any] | None = None, kube_version: str = "1.30.0",
           namespace: str = NAMESPACE, release: str = RELEASE,
           api_versions: tuple[str, ...] | None = None) -> Rendered:
    if api_versions is None:
        api_versions = served_api_versions(kube_version)
    code, out, err = render_raw(values, kube_version, namespace, release, api_versions)
    assert code == 0, f"helm template failed:\n{err}"
    return Rendered(load_all(out), kube_version, tuple(api_versions))


@pytest.fixture(scope="session")
def helm_run() -> Any:
    return _run


@pytest.fixture(scope="session", name="render")
def render_fixture() -> Any:
    """``render(values=None, kube_version="1.30.0", namespace=..., release=...,
    api_versions=None) -> Rendered``."""
    return render


@pytest.fixture(scope="session", name="render_raw")
def render_raw_fixture() -> Any:
    """``render_raw(...) -> (exit code, stdout, stderr)``, for renders that must fail."""
    return render_raw


@pytest.fixture(scope="session", name="vap_api_versions")
def vap_api_versions_fixture() -> dict[str, tuple[str, ...]]:
    """``--api-versions`` entries of a cluster serving ValidatingAdmissionPolicy in v1, in
    v1beta1, or in both."""
    return {"v1": VAP_V1, "v1beta1": VAP_V1BETA1, "both": VAP_V1 + VAP_V1BETA1}


@pytest.fixture(scope="session", name="load_yaml")
def load_yaml_fixture() -> Any:
    """The strict multi-document loader every render goes through."""
    return load_all
