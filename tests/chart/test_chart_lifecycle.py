"""What `helm uninstall` and `helm upgrade` leave behind, as the README's uninstall section tells
the operator: Helm removes every object of the chart (no hooks, nothing kept: nothing is left
that admits pods); what the service and the agent write at run time (node labels, annotations,
extended resources) is named in the README's commands."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubeschema
import pytest
import yaml
from chart.test_chart_render import CRD_GROUPS, OPTIONS

from webhook import names

ROOT = Path(__file__).resolve().parents[2]
ADMISSION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                   "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _uninstall_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("**Uninstall.**")
    return text[start:text.index("\n## ", start)]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_uninstall_removes_every_object_that_admits_pods(option: str, render: Any,
                                                        vap_api_versions: dict) -> None:
    """Helm keeps at uninstall what a hook made or what says `helm.sh/resource-policy: keep`:
    a webhook configuration with `failurePolicy: Fail` left so, pointing at the deleted
    Service, would refuse every GPU pod of the cluster."""
    rendered = render(OPTIONS[option], kubeschema.NEWEST, api_versions=vap_api_versions["v1"])
    admission = [o for o in rendered.objects if o["kind"] in ADMISSION_KINDS]
    assert [o["kind"] for o in admission].count("MutatingWebhookConfiguration") == 1
    for obj in rendered.objects:
        kept = {k: v for k, v in ((obj["metadata"].get("annotations")) or {}).items()
                if k.startswith(("helm.sh/hook", "helm.sh/resource-policy"))}
        assert not kept, (obj["kind"], obj["metadata"]["name"], kept)
        if not obj["apiVersion"].startswith(CRD_GROUPS):
            kubeschema.assert_valid(obj, (kubeschema.NEWEST,))
    for obj in admission:  # each names itself as the release's, for `helm uninstall`
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "gpuslice"


def test_the_readme_removes_everything_the_agent_publishes_on_a_node() -> None:
    """Every label and annotation the agent writes, and each default extended resource, is
    removed by the README's uninstall commands."""
    section = _uninstall_section()
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.DOTALL))
    label_line = next(line for line in commands.splitlines() if "kubectl label node" in line)
    annotate_line = next(line for line in commands.splitlines()
                         if "kubectl annotate node" in line)
    for label in (names.LABEL_GPU_PRODUCT, names.LABEL_GPU_COUNT, names.LABEL_GPU_MEMORY):
        assert f" {label}-" in label_line, label
    assert " gpu-" in label_line  # the chart's nodeLabel, put there by the operator
    for annotation in (names.ANN_NODE_GPUS, names.ANN_NODE_RESOURCES):
        assert f" {annotation}-" in annotate_line, annotation
    values = yaml.safe_load((ROOT / "charts" / "gpuslice" / "values.yaml").read_text())
    published = {values["resourceNames"][k] for k in ("gpu", "memory", "cores")}
    patch = commands[commands.index("--subresource=status"):]
    body = yaml.safe_load(patch[patch.index("'") + 1:patch.index("'", patch.index("'") + 1)])
    for key in ("capacity", "allocatable"):
        assert body["status"][key] == dict.fromkeys(published)
