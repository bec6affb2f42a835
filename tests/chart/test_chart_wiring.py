"""The rendered chart is wired together: the CLI accepts every flag the chart passes, the config
file loads as Settings, the scheduler's KubeSchedulerConfiguration points at the extender with
the right TLS, the webhook configuration selects the right pods, and cert-manager objects refer
to each other."""

from __future__ import annotations

import dataclasses
import socket
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from node.fakenvml import two_a100s

from webhook import cli, names
from webhook.admission.mutate import mutate_pod
from webhook.node import loop as agent_loop
from webhook.node.config import settings_from_args as agent_settings_from_args
from webhook.node.inventory import Inventory
from webhook.service import create_app, start_https
from webhook.settings import Settings, load_settings
from webhook.tls import ensure_dev_certs, service_names

NS = "gpuslice-system"
CUSTOM = {"resourceNames": {"gpu": "example.com/vgpu", "memory": "example.com/vgpu-mem",
                            "memoryPercentage": "example.com/vgpu-mem-pct",
                            "cores": "example.com/vgpu-cores",
                            "priority": "example.com/vgpu-priority"},
          "nodeLabel": {"key": "example.com/gpu-sharing", "value": "enabled"},
          "splitCount": 4, "defaultPolicy": "spread", "maxGpuMemoryMiB": 81920,
          "namespaceMode": "opt-in", "logLevel": "DEBUG",
          "gpuPods": {"runtimeClassName": "nvidia", "tolerations": [
              {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
          "scheduler": {"name": "shared-gpu"}, "webhook": {"port": 9443},
          "agent": {"hostPID": False, "offerExclusiveProcessGpus": True, "xidCheck": False,
                    "skipXids": [63, 74],
                    "audit": {"interval": 2.5, "toleranceMiB": 64,
                              "overLimitAction": "evict", "overLimitRounds": 5,
                              "compute": {"window": 120, "tolerancePercent": 5,
                                          "overLimitAction": "evict"}}}}

# Fields of kubescheduler.config.k8s.io/v1 (k8s.io/kube-scheduler/config/v1 types.go). The
# kube-scheduler decodes its config strictly: an unknown or misspelt field stops it at start.
KSC_FIELDS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection",
              "healthzBindAddress", "metricsBindAddress", "enableProfiling",
              "enableContentionProfiling", "percentageOfNodesToScore", "podInitialBackoffSeconds",
              "podMaxBackoffSeconds", "profiles", "extenders", "delayCacheUntilActive"}
LEADER_FIELDS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                 "resourceName", "resourceNamespace"}
PROFILE_FIELDS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
EXTENDER_FIELDS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight",
                   "bindVerb", "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable",
                   "managedResources", "ignorable"}
TLS_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData",
              "caData"}


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def _volume(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


# ----- the service: its config file and command line -----

@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_service_config_loads_as_settings_matching_the_values(
        values: dict[str, Any], render: Any, tmp_path: Path) -> None:
    rendered = render(values)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    s = load_settings(config)
    r = {"gpu": "nvidia.com/gpu", "memory": "nvidia.com/gpumem",
            "memoryPercentage": "nvidia.com/gpumem-percentage",
            "cores": "nvidia.com/gpucores", "priority": "nvidia.com/priority",
            **values.get("resourceNames", {})}
    assert s.resource_names == (r["gpu"], r["memory"], r["memoryPercentage"], r["cores"])
    assert s.resource_priority == r["priority"]
    assert s.node_selector == ({"example.com/gpu-sharing": "enabled"} if values
                               else {"gpu": "on"})
    assert s.split_count == values.get("splitCount", 10)
    assert s.default_policy == values.get("defaultPolicy", "binpack")
    assert s.max_gpu_memory_mib == values.get("maxGpuMemoryMiB")
    assert s.namespace_mode == values.get("namespaceMode", "opt-out")
    assert s.runtime_class_name == (values.get("gpuPods", {}).get("runtimeClassName") or None)
    assert list(s.tolerations) == values.get("gpuPods", {}).get("tolerations", [])
    assert s.scheduler_name == values.get("scheduler", {}).get("name", "gpuslice-scheduler")
    assert s.release_namespace == NS
    election = rendered.config("gpuslice-scheduler")["leaderElection"]
    assert s.scheduler_lease == f"{election['resourceNamespace']}/{election['resourceName']}"
    deployment = rendered.one("Deployment", "gpuslice")
    [webhook] = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "webhook"]
    [tmp] = [m for m in webhook["volumeMounts"] if s.restart_marker.startswith(m["mountPath"] + "/")]
    assert "emptyDir" in _volume(deployment, tmp["name"])  # outlives the container, not the pod
    assert (s.kube_enabled, s.placement_enabled, s.log_format) == (True, True, "json")
    assert s.service_name == rendered.one("Service", "gpuslice")["metadata"]["name"]
    assert s.webhook_config_name == \
        rendered.one("MutatingWebhookConfiguration")["metadata"]["name"]


@pytest.mark.parametrize("mode", ["secret", "cert-manager"])
def test_serve_command_line_parses_and_matches_the_pod(mode: str, render: Any,
                                                       tmp_path: Path) -> None:
    rendered = render({"tls": {"mode": mode}})
    deployment = rendered.one("Deployment", "gpuslice")
    container = rendered.container(deployment, "webhook")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    args = [str(config) if a == "/etc/gpuslice/config.yaml" else a for a in container["args"]]
    assert "/etc/gpuslice/config.yaml" in _mounts(container)
    s: Settings = cli.settings_from_args(cli.build_parser().parse_args(args))
    assert args[0] == "serve"
    assert s.tls_mode == ("secret" if mode == "secret" else "files")
    assert s.kube_enabled is True
    assert container["ports"][0]["containerPort"] == s.port
    certs = _mounts(container)[s.cert_dir]
    assert certs["readOnly"] is (mode != "secret")  # the service rotates files in secret mode
    volume = _volume(deployment, certs["name"])
    if mode == "secret":
        assert "emptyDir" in volume
        role = rendered.one("Role", "gpuslice-tls")
        assert role["metadata"]["namespace"] == s.release_namespace
        assert [s.tls_secret_name] in [r.get("resourceNames") for r in role["rules"]]
    else:
        assert volume["secret"]["secretName"] == s.tls_secret_name
        cert = rendered.one("Certificate", "gpuslice")
        assert cert["spec"]["secretName"] == s.tls_secret_name
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    probes = (container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"])
    assert [(p["path"], p["scheme"], p["port"]) for p in probes] == \
        [("/readyz", "HTTPS", "https"), ("/healthz", "HTTPS", "https")]


def test_tls_bootstrap_init_container_runs_the_bootstrap_module_with_the_same_config(
        render: Any) -> None:
    rendered = render()
    deployment = rendered.one("Deployment", "gpuslice")
    init = rendered.container(deployment, "tls-bootstrap", init=True)
    webhook = rendered.container(deployment, "webhook")
    assert init["command"] == ["python", "-m", "webhook.bootstrap"]
    assert init["args"] == ["--config", "/etc/gpuslice/config.yaml"]
    assert init["image"] == webhook["image"]  # test_bootstrap runs this exact command
    cert_dir = rendered.config("gpuslice-config")["cert_dir"]
    assert _mounts(init)[cert_dir]["name"] == _mounts(webhook)[cert_dir]["name"]
    cm = render({"tls": {"mode": "cert-manager"}}).one("Deployment", "gpuslice")
    assert "initContainers" not in cm["spec"]["template"]["spec"]


def test_webhook_pod_is_non_root_with_a_read_only_root_filesystem(render: Any) -> None:
    spec = render().one("Deployment", "gpuslice")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001  # the image's user
    for c in spec["containers"] + spec["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]


# ----- the agent -----

@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_agent_command_line_parses_and_matches_the_mounts(values: dict[str, Any],
                                                          render: Any, tmp_path: Path) -> None:
    rendered = render(values)
    ds = rendered.one("DaemonSet", "gpuslice-agent")
    container = rendered.container(ds, "agent")
    args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in container["args"]]
    s = agent_settings_from_args(cli.build_parser().parse_args(args))
    assert s.node_name == "gpu-node-1"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    r = values.get("resourceNames", {})
    assert (s.resource_gpu, s.resource_mem, s.resource_cores, s.resource_priority) == (
        r.get("gpu", "nvidia.com/gpu"), r.get("memory", "nvidia.com/gpumem"),
        r.get("cores", "nvidia.com/gpucores"), r.get("priority", "nvidia.com/priority"))
    # the outside check reads a pod as the webhook wrote it: the same names
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    w = load_settings(config)
    assert (s.resource_gpu, s.resource_mem, s.resource_cores, s.resource_priority) == (
        w.resource_gpu, w.resource_mem, w.resource_cores, w.resource_priority)
    assert s.split_count == values.get("splitCount", 10)
    assert s.log_format == "json" and s.kube_enabled
    assert s.preload_target == names.HOST_LIBRARY_DIR
    assert s.library_source == "/opt/gpuslice/libgpuslice.so"  # COPY target of the image
    mounts = _mounts(container)
    for in_pod, host in ((s.host_library_dir, names.HOST_LIBRARY_DIR),
                         (s.host_state_dir, names.HOST_STATE_DIR), (s.proc_root, "/proc")):
        assert _volume(ds, mounts[in_pod]["name"])["hostPath"]["path"] == host
    assert mounts[s.proc_root]["readOnly"] is True
    audit = {"interval": 10, "toleranceMiB": 0, "overLimitAction": "none", "overLimitRounds": 3,
             **values.get("agent", {}).get("audit", {})}
    assert (s.audit_interval, s.over_limit_tolerance_mib, s.over_limit_action,
            s.over_limit_rounds) == (audit["interval"], audit["toleranceMiB"],
                                     audit["overLimitAction"], audit["overLimitRounds"])
    compute = {"window": 60, "tolerancePercent": 10, "overLimitAction": "none",
               **audit.get("compute", {})}
    assert (s.compute_window, s.compute_tolerance, s.compute_over_limit_action) == \
        (compute["window"], compute["tolerancePercent"], compute["overLimitAction"])
    # on by default: drivers that list only the caller's PID namespace's processes to NVML
    # would hide every container's from an agent in a namespace of its own
    assert ds["spec"]["template"]["spec"].get("hostPID", False) is \
        values.get("agent", {}).get("hostPID", True)
    assert s.offer_exclusive_process is \
        values.get("agent", {}).get("offerExclusiveProcessGpus", False)
    assert (s.xid_check, s.skip_xids) == (values.get("agent", {}).get("xidCheck", True),
                                          tuple(values.get("agent", {}).get("skipXids", [])))
    assert container["ports"][0]["containerPort"] == s.metrics_port == 9400
    spec = ds["spec"]["template"]["spec"]
    label = values.get("nodeLabel", {"key": "gpu", "value": "on"})
    assert spec["nodeSelector"] == {label["key"]: label["value"]}


def test_agent_runs_on_every_tainted_gpu_node_with_node_critical_priority(render: Any) -> None:
    spec = render().one("DaemonSet", "gpuslice-agent")["spec"]["template"]["spec"]
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "system-node-critical"
    sc = spec["containers"][0]["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    privileged = render({"agent": {"privileged": True, "runtimeClassName": "nvidia"}})
    spec = privileged.one("DaemonSet", "gpuslice-agent")["spec"]["template"]["spec"]
    assert spec["containers"][0]["securityContext"]["privileged"] is True
    assert spec["runtimeClassName"] == "nvidia"


def test_agent_exits_within_its_pods_grace_period(render: Any) -> None:
    spec = render().one("DaemonSet", "gpuslice-agent")["spec"]["template"]["spec"]
    grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    assert agent_loop.SHUTDOWN_BOUND_S < grace, "SIGTERM'd agents would be SIGKILLed mid-shutdown"


@pytest.mark.parametrize("kube_version", ["1.29.0", "1.30.0"])
def test_agent_reads_other_containers_processes_without_an_apparmor_profile(
        kube_version: str, render: Any) -> None:
    # under the runtime's default AppArmor profile its ptrace reads (/proc/<pid>/maps, /root)
    # reach only processes under the same profile: an old library would never be found unused
    key = "container.apparmor.security.beta.kubernetes.io/agent"

    def agent(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        pod = render(values, kube_version).one("DaemonSet", "gpuslice-agent")["spec"]["template"]
        return pod["metadata"].get("annotations", {}), pod["spec"]["containers"][0]["securityContext"]

    annotations, sc = agent({})
    if kube_version == "1.30.0":  # the field; the beta annotation is deprecated there
        assert sc["appArmorProfile"] == {"type": "Unconfined"} and key not in annotations
    else:  # no such field before 1.30 (the strict schema check would refuse it)
        assert annotations[key] == "unconfined" and "appArmorProfile" not in sc
    for values in ({"agent": {"appArmorUnconfined": False}}, {"agent": {"privileged": True}}):
        annotations, sc = agent(values)  # left to the runtime; privileged is unconfined anyway
        assert key not in annotations and "appArmorProfile" not in sc, values


# ----- the kube-scheduler container -----

@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_scheduler_configuration_calls_the_extender_in_the_same_pod(values: dict[str, Any],
                                                                    render: Any) -> None:
    rendered = render(values)
    ksc = rendered.config("gpuslice-scheduler")
    settings = rendered.config("gpuslice-config")
    assert ksc["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert ksc["kind"] == "KubeSchedulerConfiguration"
    assert set(ksc) <= KSC_FIELDS
    assert set(ksc["leaderElection"]) <= LEADER_FIELDS
    assert ksc["leaderElection"]["leaderElect"] is True
    assert ksc["leaderElection"]["resourceNamespace"] == NS
    assert [p["schedulerName"] for p in ksc["profiles"]] == [settings["scheduler_name"]]
    assert all(set(p) <= PROFILE_FIELDS for p in ksc["profiles"])

    [ext] = ksc["extenders"]
    assert set(ext) <= EXTENDER_FIELDS and set(ext["tlsConfig"]) <= TLS_FIELDS
    assert ext["urlPrefix"] == f"https://127.0.0.1:{settings['port']}/scheduler"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["preemptVerb"], ext["bindVerb"]) == \
        ("filter", "prioritize", "preempt", "bind")
    assert ext["enableHTTPS"] is True and ext["nodeCacheCapable"] is True
    assert ext["ignorable"] is False and ext["weight"] >= 1
    # The pod's loopback, which no one outside the pod reaches: no CA pinned, so none goes
    # stale in a running scheduler (test_tls_lifecycle); client-go refuses a caFile beside it.
    assert ext["tlsConfig"] == {"insecure": True}
    managed = {m["name"]: m["ignoredByScheduler"] for m in ext["managedResources"]}
    assert managed == {settings["resource_gpu"]: False, settings["resource_mem"]: False,
                       settings["resource_cores"]: False,
                       settings["resource_mem_percent"]: True,
                       settings["resource_priority"]: True}



def test_every_verb_the_scheduler_calls_is_served_by_the_extender(render: Any) -> None:
    """kube-scheduler POSTs ``urlPrefix/<verb>`` for each verb its configuration names; one the
    service does not route is a 404, which fails that step (preemption, for preemptVerb)."""
    [ext] = render({}).config("gpuslice-scheduler")["extenders"]
    app = create_app(Settings(kube_enabled=False), cert_reload_interval=3600)
    served = {r.resource.canonical for r in app.router.routes()
              if r.method == "POST" and r.resource is not None}
    prefix = urlsplit(ext["urlPrefix"]).path
    verbs = {k: v for k, v in ext.items() if k.endswith("Verb")}
    assert set(verbs) == {"filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb"}
    assert {f"{prefix}/{v}" for v in verbs.values()} <= served


def _nodes_the_extender_sees(ksc: dict[str, Any], profile: dict[str, Any], nodes: int) -> int:
    """How many feasible nodes kube-scheduler looks for before it calls the extender's filter
    (``numFeasibleNodesToFind`` of pkg/scheduler/schedule_one.go, 1.25 to current): below 100
    nodes all of them; otherwise the profile's, else the global percentageOfNodesToScore, where
    0 (unset) means 50 - nodes/125 (at least 5), and never fewer than 100 nodes."""
    if nodes < 100:
        return nodes
    percentage = profile.get("percentageOfNodesToScore")
    if percentage is None:
        percentage = ksc.get("percentageOfNodesToScore") or 0
    if percentage == 0:
        percentage = max(50 - nodes // 125, 5)
    return max(nodes * percentage // 100, 100)


def test_every_extended_resource_of_a_mutated_hami_pod_fits_a_gpu_node(
        render: Any, tmp_path: Path) -> None:
    """kube-scheduler's NodeResourcesFit finds no node for an extended resource that no node
    advertises unless the extender manages it with ignoredByScheduler: each one the webhook
    leaves in a GPU pod (HAMi's task priority among them, which HAMi's chart manages so) is one
    the agent advertises or one the scheduler ignores."""
    rendered = render({})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    s = load_settings(config)
    [ext] = rendered.config("gpuslice-scheduler")["extenders"]
    ignored = {m["name"] for m in ext["managedResources"] if m["ignoredByScheduler"]}
    agent = rendered.container(rendered.one("DaemonSet", "gpuslice-agent"), "agent")
    args = [x.replace("$(NODE_NAME)", "gpu-node-1") for x in agent["args"]]
    a = agent_settings_from_args(cli.build_parser().parse_args(args))
    advertised = {a.resource_gpu, a.resource_mem, a.resource_cores}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hami"}, "spec": {
        "containers": [{"name": "train", "image": "x", "resources": {"limits": {
            "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30",
            "nvidia.com/priority": "0"}}}]}}
    result = mutate_pod(pod, s)
    assert result.allowed and result.pod is not None
    for container in result.pod["spec"]["containers"]:
        for resource in container["resources"]["limits"]:
            if "/" in resource:  # an extended resource
                assert resource in advertised | ignored, resource


@pytest.mark.parametrize("nodes", [99, 150, 400, 2000])
def test_scheduler_sends_every_feasible_node_to_the_extender(nodes: int, render: Any) -> None:
    """Only the extender knows which GPU of a node has room (the node totals the scheduler
    checks say nothing of one GPU's free memory or slices). kube-scheduler stops looking for
    feasible nodes at a share of the cluster and filters only those with the extender, so in
    a cluster of more than 100 GPU nodes a pod whose slice fits on one node only is reported
    unschedulable in most cycles. The profile must score every node."""
    ksc = render().config("gpuslice-scheduler")
    [profile] = ksc["profiles"]
    assert _nodes_the_extender_sees(ksc, profile, nodes) == nodes


@pytest.mark.parametrize("mode", ["secret", "cert-manager"])
def test_scheduler_container_reads_the_config_and_no_certificate(mode: str,
                                                                 render: Any) -> None:
    """It calls the extender on the pod's own loopback (no hostNetwork: only the pod's
    containers listen there) and needs no file of the cert dir, whose serving key it would
    otherwise read too."""
    rendered = render({"tls": {"mode": mode}})
    deployment = rendered.one("Deployment", "gpuslice")
    scheduler = rendered.container(deployment, "kube-scheduler")
    ksc = rendered.config("gpuslice-scheduler")
    assert not deployment["spec"]["template"]["spec"].get("hostNetwork")
    assert ksc["extenders"][0]["urlPrefix"].startswith("https://127.0.0.1:")
    assert scheduler["command"][0] == "kube-scheduler"
    [config_flag] = [a for a in scheduler["command"] if a.startswith("--config=")]
    config_path = Path(config_flag.split("=", 1)[1])
    mounts = _mounts(scheduler)
    assert _volume(deployment, mounts[str(config_path.parent)]["name"])["configMap"]["name"] \
        == "gpuslice-scheduler"
    cert_dir = rendered.config("gpuslice-config")["cert_dir"]
    certs = _mounts(rendered.container(deployment, "webhook"))[cert_dir]["name"]
    assert certs not in {m["name"] for m in mounts.values()}
    lease_role = rendered.one("Role", "gpuslice-scheduler-lease")
    assert [ksc["leaderElection"]["resourceName"]] in \
        [r.get("resourceNames") for r in lease_role["rules"]]


@pytest.mark.parametrize(("kube_version", "tag", "image"), [
    ("1.30.0", "", "registry.k8s.io/kube-scheduler:v1.30.0"),
    ("v1.31.4-eks-a737599", "", "registry.k8s.io/kube-scheduler:v1.31.4"),
    ("v1.29.8+k3s1", "", "registry.k8s.io/kube-scheduler:v1.29.8"),
    ("1.30.0", "v1.30.2", "registry.k8s.io/kube-scheduler:v1.30.2"),
])
def test_scheduler_image_follows_the_cluster_version_unless_set(
        kube_version: str, tag: str, image: str, render: Any) -> None:
    rendered = render({"scheduler": {"image": {"tag": tag}}} if tag else {}, kube_version)
    deployment = rendered.one("Deployment", "gpuslice")
    assert rendered.container(deployment, "kube-scheduler")["image"] == image


# ----- the MutatingWebhookConfiguration -----

@pytest.mark.parametrize("namespace", [NS, "gpu-ops"])
def test_webhook_never_mutates_kube_system_or_the_release_namespace(namespace: str,
                                                                    render: Any) -> None:
    for mode, operator, value in (("opt-out", "NotIn", "disabled"), ("opt-in", "In", "enabled")):
        mwc = render({"namespaceMode": mode, "webhook": {"excludedNamespaces": ["ci"]}},
                     namespace=namespace).one("MutatingWebhookConfiguration")
        [hook] = mwc["webhooks"]
        exprs = {e["key"]: e for e in hook["namespaceSelector"]["matchExpressions"]}
        assert exprs["kubernetes.io/metadata.name"]["operator"] == "NotIn"
        assert set(exprs["kubernetes.io/metadata.name"]["values"]) == \
            {"kube-system", namespace, "ci"}
        toggle = exprs[names.LABEL_NAMESPACE_WEBHOOK]
        assert (toggle["operator"], toggle["values"]) == (operator, [value])


def test_webhook_admission_settings(render: Any) -> None:
    rendered = render()
    [hook] = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Fail" and hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["timeoutSeconds"] == 10
    assert hook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""],
                              "apiVersions": ["v1"], "resources": ["pods"],
                              "scope": "Namespaced"},
                             {"operations": ["UPDATE"], "apiGroups": [""],
                              "apiVersions": ["v1"], "resources": ["pods/ephemeralcontainers"],
                              "scope": "Namespaced"}]
    ref = hook["clientConfig"]["service"]
    service = rendered.one("Service", ref["name"])
    assert ref["namespace"] == service["metadata"]["namespace"] and ref["path"] == "/mutate"
    [port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    webhook = rendered.container(rendered.one("Deployment", "gpuslice"), "webhook")
    assert port["targetPort"] in [p["name"] for p in webhook["ports"]]
    assert service["spec"]["selector"].items() <= \
        rendered.one("Deployment", "gpuslice")["spec"]["template"]["metadata"]["labels"].items()
    assert "caBundle" not in hook["clientConfig"]  # set by the bootstrap at first start


@pytest.mark.parametrize(("kube_version", "setting", "present"), [
    ("1.25.0", "auto", False), ("1.27.9", "auto", False), ("1.28.0", "auto", True),
    ("1.37.0", "auto", True), ("1.30.0", "disabled", False), ("1.27.0", "enabled", True),
])
def test_match_conditions_only_where_the_cluster_supports_them(
        kube_version: str, setting: str, present: bool, render: Any) -> None:
    values = {"webhook": {"matchConditions": setting}}
    [hook] = render(values, kube_version).one("MutatingWebhookConfiguration")["webhooks"]
    assert ("matchConditions" in hook) is present


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_match_condition_names_every_gpu_resource_for_containers_and_init_containers(
        values: dict[str, Any], render: Any) -> None:
    rendered = render(values)
    settings = rendered.config("gpuslice-config")
    [hook] = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    [cond] = hook["matchConditions"]
    expr = cond["expression"]
    listed = "[" + ", ".join(f"'{settings[k]}'" for k in (
        "resource_gpu", "resource_mem", "resource_mem_percent", "resource_cores")) + "]"
    assert expr.count(listed) == 2
    assert "object.spec.containers.exists(c, " in expr
    assert "has(object.spec.initContainers) && object.spec.initContainers.exists(c, " in expr
    assert expr.count("has(c.resources) && has(c.resources.limits)") == 2


def _pod(containers: list[dict[str, Any]],
         init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers}
    if init is not None:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def _limits(**limits: str) -> dict[str, Any]:
    return {"name": "c", "image": "x", "resources": {"limits": limits}}


@pytest.mark.parametrize(("pod", "sent"), [
    (_pod([{"name": "c", "image": "x"}]), False),
    (_pod([{"name": "c", "image": "x", "resources": {}}]), False),
    (_pod([_limits(cpu="1")]), False),
    (_pod([_limits(**{"amd.com/gpu": "1"})]), False),
    (_pod([_limits(**{"nvidia.com/gpu": "1"})]), True),
    (_pod([{"name": "a", "image": "x"}, _limits(**{"nvidia.com/gpumem": "1024"})]), True),
    (_pod([_limits(**{"nvidia.com/gpumem-percentage": "50"})]), True),
    (_pod([{"name": "c", "image": "x"}], [_limits(**{"nvidia.com/gpucores": "30"})]), True),
    (_pod([{"name": "c", "image": "x"}], [_limits(cpu="1")]), False),
], ids=["bare", "empty-resources", "cpu", "other-vendor", "gpu-limit", "second-container-gpumem",
        "percentage", "init-container", "init-container-cpu"])
def test_match_condition_selects_exactly_the_gpu_pods(pod: dict[str, Any], sent: bool,
                                                      render: Any) -> None:
    """Evaluated with cel-python (a CEL implementation; the API server uses cel-go)."""
    celpy = pytest.importorskip("celpy", reason="cel-python not installed (pip install "
                                "cel-python) to evaluate the CEL expression")
    [hook] = render().one("MutatingWebhookConfiguration")["webhooks"]
    env = celpy.Environment()
    program = env.program(env.compile(hook["matchConditions"][0]["expression"]))
    assert bool(program.evaluate({"object": celpy.json_to_cel(pod)})) is sent


@pytest.mark.parametrize(("kube_version", "entries"), [("1.31.0", 2), ("1.25.0", 1)])
def test_hiding_gpus_from_pods_without_gpus_adds_an_entry_for_exactly_those_pods(
        kube_version: str, entries: int, render: Any, tmp_path: Path) -> None:
    """podsWithoutGpus.hideGpus: the setting reaches the service; where matchConditions split
    the pods, a second entry (failurePolicy Ignore) receives exactly the pods the first does
    not; without them the one entry already receives every pod."""
    rendered = render({"podsWithoutGpus": {"hideGpus": True}}, kube_version)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    assert load_settings(config).hide_gpus_from_pods_without_gpus is True
    hooks = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    assert [h["name"] for h in hooks] == ["pods.gpuslice.io", "pods-without-gpus.gpuslice.io"][
        :entries]
    assert [h["failurePolicy"] for h in hooks] == ["Fail", "Ignore"][:entries]
    if entries == 1:
        assert "matchConditions" not in hooks[0]
        return
    gpu, other = hooks
    assert {k: v for k, v in gpu.items() if k not in ("name", "failurePolicy", "matchConditions")} \
        == {k: v for k, v in other.items() if k not in ("name", "failurePolicy", "matchConditions")}
    celpy = pytest.importorskip("celpy", reason="cel-python not installed")
    env = celpy.Environment()
    sends = [env.program(env.compile(h["matchConditions"][0]["expression"])) for h in hooks]
    for pod in [_pod([{"name": "c", "image": "x"}]), _pod([_limits(cpu="1")]),
                _pod([_limits(**{"nvidia.com/gpu": "1"})]),
                _pod([{"name": "c", "image": "x"}], [_limits(**{"nvidia.com/gpucores": "30"})]),
                _pod([_limits(**{"nvidia.com/mig-1g.10gb": "1"})])]:
        got = [bool(p.evaluate({"object": celpy.json_to_cel(pod)})) for p in sends]
        assert got in ([True, False], [False, True]), pod


def test_pods_without_gpus_are_left_alone_by_default(render: Any, tmp_path: Path) -> None:
    rendered = render()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    assert load_settings(config).hide_gpus_from_pods_without_gpus is False
    assert len(rendered.one("MutatingWebhookConfiguration")["webhooks"]) == 1


def test_existing_ca_bundle_is_kept_by_an_upgrade_render(render: Any) -> None:
    """helm upgrade re-renders the webhook configuration; `lookup` keeps the bootstrap's
    caBundle (offline renders have no cluster, so there is none to keep here)."""
    template = (Path(__file__).resolve().parents[2] / "charts/gpuslice/templates"
                / "mutatingwebhook.yaml").read_text()
    assert 'lookup "admissionregistration.k8s.io/v1" "MutatingWebhookConfiguration"' in template
    assert "caBundle: {{ . }}" in template


# ----- cert-manager -----

@pytest.mark.parametrize("issuer", [None, {"name": "corp-ca", "kind": "ClusterIssuer"}])
def test_cert_manager_objects_refer_to_each_other(issuer: dict[str, Any] | None,
                                                  render: Any) -> None:
    cm: dict[str, Any] = {"mode": "cert-manager"}
    if issuer:
        cm["certManager"] = {"issuerRef": issuer}
    rendered = render({"tls": cm})
    mwc = rendered.one("MutatingWebhookConfiguration")
    cert = rendered.one("Certificate", "gpuslice")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{cert['metadata']['namespace']}/{cert['metadata']['name']}"
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    svc = mwc["webhooks"][0]["clientConfig"]["service"]
    assert f"{svc['name']}.{svc['namespace']}.svc" in cert["spec"]["dnsNames"]  # the API server's
    assert set(cert["spec"]["dnsNames"]) <= set(service_names(NS, "gpuslice"))
    assert "server auth" in cert["spec"]["usages"]
    ref = cert["spec"]["issuerRef"]
    if issuer:
        assert ref == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert rendered.all("Issuer") == []
    else:
        ca_issuer = rendered.one("Issuer", ref["name"])
        ca_cert = rendered.one("Certificate", "gpuslice-ca")
        assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
        assert ca_cert["spec"]["isCA"] is True
        rendered.one("Issuer", ca_cert["spec"]["issuerRef"]["name"])  # the self-signed root


def test_service_monitors_select_the_metrics_services(render: Any) -> None:
    rendered = render({"metrics": {"serviceMonitor": {"enabled": True,
                                                      "labels": {"release": "prom"}}}})
    for sm_name, svc_name in (("gpuslice-webhook", "gpuslice"),
                              ("gpuslice-agent", "gpuslice-agent-metrics")):
        sm = rendered.one("ServiceMonitor", sm_name)
        svc = rendered.one("Service", svc_name)
        assert sm["metadata"]["labels"]["release"] == "prom"
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    tls = rendered.one("ServiceMonitor", "gpuslice-webhook")["spec"]["endpoints"][0]["tlsConfig"]
    assert tls["ca"]["secret"]["key"] == "ca.crt"
    assert tls["serverName"] in service_names(NS, "gpuslice")


def test_config_changes_roll_the_webhook_pods(render: Any) -> None:
    def checksums(values: dict[str, Any]) -> dict[str, str]:
        meta = render(values).one("Deployment", "gpuslice")["spec"]["template"]["metadata"]
        return {k: v for k, v in meta["annotations"].items() if k.startswith("checksum/")}

    base = checksums({})
    assert checksums({"splitCount": 3})["checksum/config"] != base["checksum/config"]
    assert checksums({"scheduler": {"extender": {"weight": 3}}})["checksum/scheduler"] != \
        base["checksum/scheduler"]


@pytest.mark.parametrize(("release", "namespace"),
                         [("gpuslice", "ml-platform-shared-gpu-sharing-for-research-teams-prod"),
                          ("gpuslice-production-cluster-eu-west-1", "gpuslice-system-eu")],
                         ids=["namespace", "release"])
def test_cert_manager_common_names_fit_x509_for_long_names(release: str, namespace: str,
                                                           render: Any) -> None:
    """cert-manager's webhook denies a Certificate whose commonName has more than 64 bytes
    ("spec.commonName: Too long"); the serving certificate would never be issued."""
    rendered = render({"tls": {"mode": "cert-manager"}}, namespace=namespace, release=release)
    for cert in rendered.all("Certificate"):
        assert len(cert["spec"].get("commonName", "").encode()) <= 64, cert["metadata"]["name"]
    [svc] = [s["metadata"]["name"] for s in rendered.all("Service")
             if not s["metadata"]["name"].endswith("-agent-metrics")]
    serving = [c for c in rendered.all("Certificate") if not c["spec"].get("isCA")]
    assert [f"{svc}.{namespace}.svc" in c["spec"]["dnsNames"] for c in serving] == [True]


# ----- listening: the pod's addresses, IPv4 and IPv6 -----

def _free_port() -> int:
    """A port free on both loopbacks (the servers below may bind one socket per family)."""
    with socket.socket(socket.AF_INET6) as s6:
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s6.bind(("::", 0))
        return int(s6.getsockname()[1])


async def _get(url: str) -> int:
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    async with aiohttp.ClientSession() as session, \
            session.get(url, ssl=insecure, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return resp.status


@pytest.mark.parametrize("address", ["127.0.0.1", "[::1]"], ids=["ipv4", "ipv6"])
async def test_webhook_and_agent_serve_their_probes_on_the_pods_ipv4_and_ipv6_addresses(
        address: str, render: Any, tmp_path: Path) -> None:
    """The kubelet probes, the API server calls the webhook and Prometheus scrapes at the pod's
    IP, which is an IPv6 address on an IPv6 (or IPv6-first dual-stack) cluster: with the
    settings the chart gives them, both servers must accept connections on either family."""
    rendered = render()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    port = _free_port()
    s = load_settings(config, {"cert_dir": str(tmp_path / "certs"), "port": port,
                               "kube_enabled": False, "placement_enabled": False})
    ensure_dev_certs(tmp_path / "certs", NS, s.service_name)
    runner = await start_https(create_app(s), s.host, s.port)
    try:
        assert await _get(f"https://{address}:{port}/healthz") == 200
    finally:
        await runner.cleanup()

    container = rendered.container(rendered.one("DaemonSet", "gpuslice-agent"), "agent")
    args = [a.replace("$(NODE_NAME)", "gpu-node-1") for a in container["args"]]
    agent_settings = dataclasses.replace(
        agent_settings_from_args(cli.build_parser().parse_args(args)), kube_enabled=False,
        metrics_port=_free_port(), host_library_dir=str(tmp_path / "lib"),
        host_state_dir=str(tmp_path / "state"), proc_root=str(tmp_path / "proc"))
    agent = agent_loop.Agent(agent_settings, b"\x7fELF", inventory=Inventory(two_a100s()))
    await agent.start()
    try:
        assert await _get(f"http://{address}:{agent.metrics_port}/healthz") == 200
    finally:
        await agent.close()
