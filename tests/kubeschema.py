"""Validate objects against the Kubernetes OpenAPI schemas (kubernetes-validate --strict).

Every object gpuslice emits (mutated pods, rendered chart objects) goes through
:func:`assert_valid` for the oldest supported Kubernetes (1.25) and the newest schema the
installed kubernetes-validate ships.
"""

from __future__ import annotations

import functools
from typing import Any

import kubernetes_validate
from kubernetes_validate import utils as _kv_utils

# kubernetes-validate re-reads and re-parses its JSON schema files on every call (~25 ms each);
# parse each file once. The validator only reads the parsed schemas.
if not hasattr(_kv_utils.schema_contents, "cache_info"):
    _kv_utils.schema_contents = functools.lru_cache(maxsize=None)(_kv_utils.schema_contents)

OLDEST = "1.25.0"
NEWEST = _kv_utils.latest_version()
VERSIONS = (OLDEST, NEWEST)


def schema_errors(obj: dict[str, Any], versions: tuple[str, ...] = VERSIONS) -> list[str]:
    """Return one message per version whose strict schema rejects ``obj`` (empty when valid)."""
    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"k8s {version}: {exc.message} at {path or '<root>'}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"k8s {version}: {exc.message}")
    return errors


def assert_valid(obj: dict[str, Any], versions: tuple[str, ...] = VERSIONS) -> None:
    errors = schema_errors(obj, versions)
    name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    assert not errors, f"{name} fails the Kubernetes schema:\n" + "\n".join(errors)
