"""Rendering the chart with the real helm binary (``.tools/helm``, from ``scripts/setup.sh``).

``render(values, kube_version)`` runs ``helm template`` once per distinct input (cached) and
returns a :class:`Rendered` with the objects; ``helm_run(args)`` runs any helm command.
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
def _render_cached(values_json: str, kube_version: str, namespace: str,
                   release: str) -> tuple[int, str, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(values_json)  # JSON is YAML
    try:
        proc = _run(["template", release, str(CHART), "--namespace", namespace,
                     "--kube-version", kube_version, "-f", f.name])
    finally:
        os.unlink(f.name)
    return proc.returncode, proc.stdout, proc.stderr


def render_raw(values: dict[str, Any] | None = None, kube_version: str = "1.30.0",
               namespace: str = NAMESPACE, release: str = RELEASE) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``helm template`` with ``values``."""
    return _render_cached(json.dumps(values or {}, sort_keys=True), kube_version, namespace,
                          release)


def render(values: dict[str, Any] | None = None, kube_version: str = "1.30.0",
           namespace: str = NAMESPACE, release: str = RELEASE) -> Rendered:
    code, out, err = render_raw(values, kube_version, namespace, release)
    assert code == 0, f"helm template failed:\n{err}"
    return Rendered(load_all(out), kube_version)


@pytest.fixture(scope="session")
def helm_run() -> Any:
    return _run


@pytest.fixture(scope="session", name="render")
def render_fixture() -> Any:
    """``render(values=None, kube_version="1.30.0", namespace=..., release=...) -> Rendered``."""
    return render


@pytest.fixture(scope="session", name="render_raw")
def render_raw_fixture() -> Any:
    """``render_raw(...) -> (exit code, stdout, stderr)``, for renders that must fail."""
    return render_raw


@pytest.fixture(scope="session", name="load_yaml")
def load_yaml_fixture() -> Any:
    """The strict multi-document loader every render goes through."""
    return load_all
