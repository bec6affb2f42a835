"""Publishing the node's GPUs: the exact patch bodies and content types on the wire."""

from __future__ import annotations

import json

import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client
from kubeschema import assert_valid

from webhook.node.config import AgentSettings
from webhook.node.inventory import HEALTHY, UNHEALTHY, Discovery, Gpu
from webhook.node.publish import (
    MERGE_PATCH,
    Publisher,
    desired_state,
    label_value,
    metadata_patch,
    status_patch,
)

SETTINGS = AgentSettings(node_name="gpu-node-1")
A = Gpu("GPU-aaaa", 0, "NVIDIA A100-SXM4-80GB", 81920, HEALTHY)
B = Gpu("GPU-bbbb", 1, "NVIDIA A100-SXM4-80GB", 81920, UNHEALTHY)
TWO = Discovery(available=True, gpus=(A, B), driver_version="550")
ANNOTATION = ('[{"uuid":"GPU-aaaa","index":0,"product":"NVIDIA A100-SXM4-80GB",'
              '"memoryMiB":81920,"health":"Healthy"},'
              '{"uuid":"GPU-bbbb","index":1,"product":"NVIDIA A100-SXM4-80GB",'
              '"memoryMiB":81920,"health":"Unhealthy"}]')


def _node(name: str = "gpu-node-1") -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"gpu": "on"}},
            "status": {"capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"},
                       "allocatable": {"cpu": "31", "memory": "250Gi", "pods": "110"}}}


@pytest.mark.parametrize(("product", "label"), [
    ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
    ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
    ("NVIDIA GeForce RTX 4090 (rev a1)", "NVIDIA-GeForce-RTX-4090-rev-a1"),
    ("  --weird/name__  ", "weird-name"),
    ("x" * 80, "x" * 63),
    ("", ""),
])
def test_label_value_makes_product_names_valid_label_values(product: str, label: str) -> None:
    assert label_value(product) == label


def test_resources_count_only_healthy_gpus_annotation_lists_all() -> None:
    want = desired_state(TWO, SETTINGS)
    assert want.annotation == ANNOTATION
    assert json.loads(want.annotation)[1]["health"] == "Unhealthy"
    assert want.labels == {"gpuslice.io/gpu.product": "NVIDIA-A100-SXM4-80GB",
                           "gpuslice.io/gpu.count": "2", "gpuslice.io/gpu.memory": "81920"}
    assert want.resources == {"nvidia.com/gpu": "10", "nvidia.com/gpumem": "81920",
                              "nvidia.com/gpucores": "100"}


def test_resource_names_and_split_count_follow_the_settings() -> None:
    s = AgentSettings(node_name="n", split_count=4, resource_gpu="example.com/vgpu",
                      resource_mem="example.com/vmem", resource_cores="example.com/vcores")
    assert desired_state(Discovery(True, (A,)), s).resources == {
        "example.com/vgpu": "4", "example.com/vmem": "81920", "example.com/vcores": "100"}


@pytest.mark.parametrize("discovery", [Discovery(available=False, reason="driver not loaded"),
                                       Discovery(available=True, gpus=())])
def test_a_node_without_driver_or_gpus_publishes_zeros_and_no_product(
        discovery: Discovery) -> None:
    want = desired_state(discovery, SETTINGS)
    assert want.annotation == "[]"
    assert want.labels == {"gpuslice.io/gpu.product": None, "gpuslice.io/gpu.count": "0",
                           "gpuslice.io/gpu.memory": "0"}
    assert set(want.resources.values()) == {"0"}
    patch = metadata_patch({}, {"gpuslice.io/gpu.product": "old"}, want)
    assert patch is not None and patch["metadata"]["labels"]["gpuslice.io/gpu.product"] is None


def test_no_patch_when_the_node_already_carries_everything() -> None:
    want = desired_state(TWO, SETTINGS)
    labels = {k: v for k, v in want.labels.items() if v is not None}
    assert metadata_patch({"gpuslice.io/gpus": ANNOTATION}, labels, want) is None
    assert status_patch(dict(want.resources), dict(want.resources), want) is None
    assert status_patch(dict(want.resources), {}, want) is not None


async def test_quantities_the_api_server_canonicalised_need_no_patch() -> None:
    """The API server stores quantities in canonical form: ten GPUs' "1000" gpucores come
    back as "1k" (and 125 slices of eight GPUs as "1k" too). Compared as text, the resources
    differed at every round: a nodes/status PATCH (a write every node watcher sees) and an
    INFO line each interval, for ever."""
    ten = Discovery(True, tuple(Gpu(f"GPU-{i}", i, "NVIDIA L40S", 46068, HEALTHY)
                                for i in range(10)))
    want = desired_state(ten, SETTINGS)
    assert want.resources["nvidia.com/gpucores"] == "1000"
    stored = {**want.resources, "nvidia.com/gpucores": "1k"}
    assert status_patch(stored, stored, want) is None
    assert status_patch({**stored, "nvidia.com/gpucores": "2k"}, stored, want) is not None
    async with FakeKube() as kube:
        node = _node()
        for key in ("capacity", "allocatable"):
            node["status"][key].update(stored)
        kube.put(node)
        async with kube.api_client() as api:
            outcome = await Publisher(api, SETTINGS).publish(ten)
        assert not outcome.status_patched
        assert kube.requests_to("PATCH", r"^/api/v1/nodes/gpu-node-1/status$") == []


async def test_publish_sends_exact_merge_patches_to_node_and_status() -> None:
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            outcome = await Publisher(api, SETTINGS).publish(TWO)
        assert outcome.metadata_patched and outcome.status_patched
        meta = kube.requests_to("PATCH", r"^/api/v1/nodes/gpu-node-1$")
        status = kube.requests_to("PATCH", r"^/api/v1/nodes/gpu-node-1/status$")
        assert len(meta) == len(status) == 1
        assert meta[0].content_type == status[0].content_type == MERGE_PATCH
        assert meta[0].body == {"metadata": {
            "annotations": {"gpuslice.io/gpus": ANNOTATION, "gpuslice.io/resources":
                            "nvidia.com/gpu,nvidia.com/gpucores,nvidia.com/gpumem"},
            "labels": {"gpuslice.io/gpu.product": "NVIDIA-A100-SXM4-80GB",
                       "gpuslice.io/gpu.count": "2", "gpuslice.io/gpu.memory": "81920"}}}
        res = {"nvidia.com/gpu": "10", "nvidia.com/gpumem": "81920", "nvidia.com/gpucores": "100"}
        assert status[0].body == {"status": {"capacity": res, "allocatable": res}}
        node = kube.get("nodes", "gpu-node-1")
        assert node["status"]["capacity"]["cpu"] == "32"  # kubelet's resources untouched
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "10"
        assert node["metadata"]["labels"]["gpu"] == "on"
        assert_valid(node)


async def test_second_publish_reads_and_sends_no_patch() -> None:
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            await pub.publish(TWO)
            n = len(kube.requests)
            outcome = await pub.publish(TWO)
        assert not outcome.metadata_patched and not outcome.status_patched
        assert [(r.method, r.path) for r in kube.requests[n:]] == [
            ("GET", "/api/v1/nodes/gpu-node-1"),
            ("GET", "/api/v1/pods")]  # what pods hold on the unhealthy GPU


async def test_publish_reasserts_after_the_node_object_is_recreated() -> None:
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            await pub.publish(TWO)
            kube.delete("nodes", "gpu-node-1")
            kube.put(_node())  # kubelet re-registers: no capacity, no annotation
            outcome = await pub.publish(TWO)
        assert outcome.metadata_patched and outcome.status_patched
        node = kube.get("nodes", "gpu-node-1")
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "10"
        assert node["metadata"]["annotations"]["gpuslice.io/gpus"] == ANNOTATION


async def test_a_resource_another_writer_keeps_resetting_is_warned_of_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """NVIDIA's device plugin left on the node (a GPU Operator's): the kubelet puts the
    physical count back into nvidia.com/gpu at each status update and the agent sets it again,
    the scheduler seeing one or the other (Project-HAMi/HAMi#829, #736). Say so, once."""
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            await pub.publish(TWO)
            for _ in range(3):
                node = kube.get("nodes", "gpu-node-1")
                for key in ("capacity", "allocatable"):
                    node["status"][key]["nvidia.com/gpu"] = "2"  # the device plugin's, by kubelet
                kube.put(node)
                outcome = await pub.publish(TWO)
                assert outcome.status_patched
            kube.delete("nodes", "gpu-node-1")
            kube.put(_node())  # re-registered without our resources: nobody else's doing
            await pub.publish(TWO)
            node = kube.get("nodes", "gpu-node-1")
            for key in ("capacity", "allocatable"):  # the kubelet's reset of a rebuilt node
                node["status"][key].update(dict.fromkeys(
                    ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores"), "0"))
            kube.put(node)
            assert (await pub.publish(TWO)).status_patched
        assert kube.get("nodes", "gpu-node-1")["status"]["capacity"]["nvidia.com/gpu"] == "10"
    warned = [(r.getMessage(), r.resource, r.published, r.found) for r in caplog.records
              if r.levelname == "WARNING" and r.name == "webhook.node.publish"]
    message = ("a resource the agent publishes was changed by another writer (a device "
               "plugin? gpuslice needs none on its nodes); setting it back")
    assert warned == [(message, "nvidia.com/gpu", "10", "2")]


async def test_live_pod_uids_lists_this_nodes_pods_only() -> None:
    async with FakeKube() as kube:
        mine = kube.put({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": "a", "namespace": "ml"},
                         "spec": {"nodeName": "gpu-node-1", "containers": []}})
        kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b"},
                  "spec": {"nodeName": "other", "containers": []}})
        async with kube.api_client() as api:
            uids = await Publisher(api, SETTINGS).live_pod_uids()
        assert uids == {mine["metadata"]["uid"]}
        req = kube.requests_to("GET", r"^/api/v1/pods$")[0]
        assert req.query["fieldSelector"] == "spec.nodeName=gpu-node-1"


def test_the_extenders_reader_accepts_the_published_annotation() -> None:
    from webhook.placement.inventory import parse_inventory
    gpus = parse_inventory(desired_state(TWO, SETTINGS).annotation)
    assert [(g.uuid, g.index, g.memory_mib, g.healthy) for g in gpus] == [
        ("GPU-aaaa", 0, 81920, True), ("GPU-bbbb", 1, 81920, False)]


@pytest.mark.parametrize(("annotation", "uuids"), [
    ('[{"uuid":"GPU-aaaa","index":0},{"uuid":"GPU-bbbb"}]', {"GPU-aaaa", "GPU-bbbb"}),
    ('[1, "GPU-x", null, [], {"uuid": 5}, {"index": 0}, {"uuid": "GPU-aaaa"}]', {"GPU-aaaa"}),
    ('{"uuid": "GPU-aaaa"}', set()),
    ("GPU-aaaa", set()),
    ("", set()),
])
def test_the_uuids_of_an_edited_annotation_are_read_where_they_read(annotation: str, uuids: set) -> None:
    # the annotation is the node's, which a cluster admin may edit: what the agent published
    # before (GPUs pods may still hold slices of) is read from what is left of it, never raised
    from webhook.node.publish import _published_uuids
    assert _published_uuids({"gpuslice.io/gpus": annotation}) == uuids


def test_a_gpu_whose_memory_was_never_readable_is_left_out_of_the_annotation() -> None:
    from webhook.placement.inventory import parse_inventory
    lost = Gpu("GPU-cccc", 2, "", 0, UNHEALTHY)
    want = desired_state(Discovery(True, (A, lost)), SETTINGS)
    assert [g.uuid for g in parse_inventory(want.annotation)] == ["GPU-aaaa"]
    assert want.labels["gpuslice.io/gpu.count"] == "1"


RENAMED = AgentSettings(node_name="gpu-node-1", resource_gpu="example.com/vgpu",
                        resource_mem="example.com/vmem", resource_cores="example.com/vcores")
OLD_NAMES = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores")


async def test_renamed_resources_take_the_old_names_off_the_node() -> None:
    """`helm upgrade --set resourceNames...`: the new agent published the new names and left
    the old ones in the node's capacity for ever. The webhook then no longer sends pods asking
    for the old names, so such a pod went to the default scheduler, which found "10
    nvidia.com/gpu" on the node and started it unmutated: no library, no cap, and a CUDA
    image's NVIDIA_VISIBLE_DEVICES=all (every GPU of the node)."""
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            await Publisher(api, SETTINGS).publish(TWO)
            node = kube.get("nodes", "gpu-node-1")
            assert node["metadata"]["annotations"]["gpuslice.io/resources"] == ",".join(
                sorted(OLD_NAMES))
            await Publisher(api, RENAMED).publish(TWO)  # the upgraded agent
            node = kube.get("nodes", "gpu-node-1")
            for key in ("capacity", "allocatable"):
                assert not set(OLD_NAMES) & set(node["status"][key]), node["status"][key]
                assert node["status"][key]["example.com/vgpu"] == "10"
            assert node["status"]["capacity"]["cpu"] == "32"  # kubelet's untouched
            assert node["metadata"]["annotations"]["gpuslice.io/resources"] == (
                "example.com/vcores,example.com/vgpu,example.com/vmem")
            assert_valid(node)
            n = len(kube.requests)
            outcome = await Publisher(api, RENAMED).publish(TWO)
        assert not outcome.metadata_patched and not outcome.status_patched
        assert len(kube.requests) == n + 2  # the reads of the node and its pods only


async def test_an_old_name_published_again_by_another_owner_is_removed_once() -> None:
    """After the rename, nvidia.com/gpu may belong to another device plugin (kubelet puts its
    capacity back): the agent takes an old name off once, not at every round."""
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            await Publisher(api, SETTINGS).publish(TWO)
            await Publisher(api, RENAMED).publish(TWO)
            node = kube.get("nodes", "gpu-node-1")
            for key in ("capacity", "allocatable"):
                node["status"][key]["nvidia.com/gpu"] = "2"  # the device plugin's, by kubelet
            kube.put(node)
            await Publisher(api, RENAMED).publish(TWO)
        assert kube.get("nodes", "gpu-node-1")["status"]["capacity"]["nvidia.com/gpu"] == "2"


async def test_a_rename_cut_short_after_the_first_patch_is_finished_by_the_next_round() -> None:
    """The agent killed (or its status patch refused) between its patches: the names it
    published before are still recorded, so its next round still takes them off."""
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            await Publisher(api, SETTINGS).publish(TWO)
            kube.fail("PATCH", r"^/api/v1/nodes/gpu-node-1/status$", 500)
            with pytest.raises(Exception):  # noqa: B017 (the client's ApiException)
                await Publisher(api, RENAMED).publish(TWO)
            recorded = kube.get("nodes", "gpu-node-1")["metadata"]["annotations"][
                "gpuslice.io/resources"].split(",")
            assert set(OLD_NAMES) <= set(recorded)
            await Publisher(api, RENAMED).publish(TWO)
        node = kube.get("nodes", "gpu-node-1")
        assert not set(OLD_NAMES) & set(node["status"]["capacity"])
        assert node["status"]["capacity"]["example.com/vmem"] == "81920"


async def test_an_old_name_left_in_allocatable_alone_is_taken_off() -> None:
    # an old name in allocatable but no longer in capacity (a status update of the kubelet's
    # between the two): still on the node for the scheduler, which fits pods on allocatable
    async with FakeKube() as kube:
        node = _node()
        node["metadata"]["annotations"] = {"gpuslice.io/resources": "nvidia.com/gpu"}
        node["status"]["allocatable"]["nvidia.com/gpu"] = "10"
        kube.put(node)
        async with kube.api_client() as api:
            await Publisher(api, RENAMED).publish(Discovery(True, (A,), "550"))
        node = kube.get("nodes", "gpu-node-1")
        assert "nvidia.com/gpu" not in node["status"]["allocatable"]
        assert node["status"]["allocatable"]["example.com/vgpu"] == "10"
        # what pods hold of it, from the watch cache (every node's agent asks)
        assert [r.query.get("resourceVersion") for r in kube.requests_to("GET", r"^/api/v1/pods$")] == ["0"]


async def test_gpus_gone_past_departed_kept_are_forgotten_unless_pods_hold_them() -> None:
    # GPUs replaced one after another (a new UUID each time): the publisher remembers the gone
    # ones (pods may hold slices of them) and lists the node's pods every round for them; past
    # DEPARTED_KEPT it forgets those no pod holds.  A round without NVML, where every GPU is
    # missing, forgets nothing
    from webhook.node.inventory import DEPARTED_KEPT

    def one(i: int) -> Discovery:
        return Discovery(True, (Gpu(f"GPU-old-{i}", 0, A.product, 81920, HEALTHY),), "550")

    async with FakeKube() as kube:
        kube.put(_node())
        kube.put(_on(_pod("on-3", [_slice("c", 1, 1024, 10)]), c="GPU-old-3"))
        kube.put(_pod("plain", [_asking("c", 0)]))  # no annotations at all
        noted = _pod("noted", [_asking("c", 0)])
        noted["metadata"]["annotations"] = {"example.com/last-gpu": "GPU-old-5"}  # not a slice
        kube.put(noted)
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            for i in range(DEPARTED_KEPT + 1):
                await pub.publish(one(i))
            assert len(pub._seen) == DEPARTED_KEPT + 1  # 16 gone: kept
            await pub.publish(Discovery(available=False, reason="NVML initialisation failed"))
            assert len(pub._seen) == DEPARTED_KEPT + 1
            await pub.publish(one(DEPARTED_KEPT + 1))  # the 17th gone
            assert pub._seen == {"GPU-old-3", f"GPU-old-{DEPARTED_KEPT + 1}"}


def test_a_record_naming_native_resources_takes_none_of_them_off() -> None:
    from webhook.node.publish import recorded_resources
    assert recorded_resources({"gpuslice.io/resources": (
        "cpu, memory,kubernetes.io/batch,x.kubernetes.io/y,,bad name/x,nvidia.com/gpu ")}) == {
        "nvidia.com/gpu"}
    want = desired_state(TWO, RENAMED)
    patch = status_patch({"nvidia.com/gpu": "10"}, {}, want, {"nvidia.com/gpu": 0, "gone.io/x": 0})
    assert patch is not None
    assert patch["status"]["capacity"]["nvidia.com/gpu"] is None
    assert "gone.io/x" not in patch["status"]["capacity"]  # not on the node: nothing to send


def test_an_old_name_pods_hold_is_set_to_what_they_hold_in_capacity_and_allocatable_both() -> None:
    want = desired_state(TWO, RENAMED)
    mine = dict(want.resources)
    assert status_patch({**mine, "nvidia.com/gpu": "3"}, {**mine, "nvidia.com/gpu": "3"}, want,
                        {"nvidia.com/gpu": 3}) is None
    # one of the two differs (the kubelet's reset of allocatable, say): both are sent
    for capacity, allocatable in (("3", "10"), ("10", "3"), ("3", None)):
        have_alloc = {**mine, "nvidia.com/gpu": allocatable} if allocatable else mine
        patch = status_patch({**mine, "nvidia.com/gpu": capacity}, have_alloc, want, {"nvidia.com/gpu": 3})
        assert patch is not None
        assert patch["status"]["capacity"]["nvidia.com/gpu"] == patch["status"]["allocatable"]["nvidia.com/gpu"] \
            == "3"


def _pod(name: str, containers: list[dict], init: list[dict] | None = None,
         phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"nodeName": "gpu-node-1", "containers": containers,
                     "initContainers": init or []},
            "status": {"phase": phase}}


def _asking(name: str, gpus: int, restart: str | None = None) -> dict:
    c: dict = {"name": name, "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
    if restart:
        c["restartPolicy"] = restart
    return c


async def test_an_old_name_pods_still_hold_stays_at_what_they_hold_until_they_end() -> None:
    """Pods admitted under the old names before the upgrade still run: the kubelet admits
    them again when it restarts, and rejects one asking for a resource the node has no more
    of (OutOfnvidia.com/gpu). The old name stays at what they hold, so no new pod fits, and
    goes when the last of them ends."""
    async with FakeKube() as kube:
        kube.put(_node())
        kube.put(_pod("a", [_asking("c", 1), _asking("d", 2)]))
        kube.put(_pod("b", [_asking("c", 1)], init=[_asking("i", 3), _asking("s", 1, "Always")]))
        kube.put(_pod("done", [_asking("c", 4)], phase="Succeeded"))
        async with kube.api_client() as api:
            await Publisher(api, SETTINGS).publish(TWO)
            await Publisher(api, RENAMED).publish(TWO)
            node = kube.get("nodes", "gpu-node-1")
            for key in ("capacity", "allocatable"):  # a: 3; b: max(1 + 1, 3); done: 0
                assert node["status"][key]["nvidia.com/gpu"] == "6"
                assert "nvidia.com/gpumem" not in node["status"][key]
                assert node["status"][key]["example.com/vgpu"] == "10"
            assert "nvidia.com/gpu" in node["metadata"]["annotations"]["gpuslice.io/resources"]
            n = len(kube.requests_to("PATCH", r"/status$"))
            await Publisher(api, RENAMED).publish(TWO)
            assert len(kube.requests_to("PATCH", r"/status$")) == n  # nothing changed
            kube.delete("pods", "a", "ml")
            await Publisher(api, RENAMED).publish(TWO)
            assert kube.get("nodes", "gpu-node-1")["status"]["capacity"]["nvidia.com/gpu"] == "3"
            kube.delete("pods", "b", "ml")
            await Publisher(api, RENAMED).publish(TWO)
        node = kube.get("nodes", "gpu-node-1")
        assert "nvidia.com/gpu" not in node["status"]["capacity"]
        assert node["metadata"]["annotations"]["gpuslice.io/resources"] == (
            "example.com/vcores,example.com/vgpu,example.com/vmem")


@pytest.mark.parametrize(("containers", "init", "phase", "held"), [
    ([_asking("c", 1), _asking("d", 2)], [], "Running", 3),
    # a sidecar started before an init container runs beside it: max(1 + 1, 1 + 3)
    ([_asking("c", 1)], [_asking("s", 1, "Always"), _asking("i", 3)], "Running", 4),
    # started after it, not: max(1 + 1, 3)
    ([_asking("c", 1)], [_asking("i", 3), _asking("s", 1, "Always")], "Running", 3),
    ([_asking("c", 1)], [_asking("s", 1, "Always"), _asking("t", 2, "Always")], "Pending", 4),
    ([_asking("c", 1)], [_asking("i", 1), _asking("j", 2)], "Running", 2),
    ([_asking("c", 4)], [_asking("s", 1, "Always")], "Failed", 0),
])
async def test_what_a_pod_holds_is_what_the_kubelet_counts_at_admission(
        containers: list[dict], init: list[dict], phase: str, held: int) -> None:
    from webhook.node.publish import held_by_pods
    async with client.ApiClient() as api:
        pod = api._ApiClient__deserialize(_pod("p", containers, init, phase), "V1Pod")
    assert held_by_pods([pod], ["nvidia.com/gpu"]) == {"nvidia.com/gpu": held}


def _on(pod: dict, **devices: str) -> dict:
    pod["metadata"]["annotations"] = {f"gpuslice.io/devices.{c}": u for c, u in devices.items()}
    return pod


def _slice(name: str, gpus: int, mem: int, cores: int) -> dict:
    return {"name": name, "image": "cuda", "resources": {"limits": {
        "nvidia.com/gpu": str(gpus), "nvidia.com/gpumem": str(mem),
        "nvidia.com/gpucores": str(cores)}}}


async def _free(node: dict, pods: list[dict]) -> dict[str, int]:
    """What the scheduler's own fit check (NodeResourcesFit: the chart does not let it ignore
    the three names) and the kubelet's admission see left: allocatable less what the node's
    live pods ask."""
    from kubernetes_asyncio import client

    from webhook.node.publish import held_by_pods
    async with client.ApiClient() as api:
        objs = [api._ApiClient__deserialize(p, "V1Pod") for p in pods]
    names = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores")
    held = held_by_pods(objs, names)
    return {k: int(node["status"]["allocatable"][k]) - held[k] for k in names}


async def test_pods_on_an_unhealthy_gpu_leave_the_healthy_gpus_room_whole() -> None:
    """GPU-bbbb failed while pods ran on it: they still ask for their slices, which the
    scheduler and the kubelet count against the node's totals. Totals of the healthy GPU alone
    let those pods eat its room (an empty 80 GiB GPU refused a 40 GiB pod by the scheduler's
    own check, and a kubelet restart rejects running pods as OutOf...): the totals keep what
    pods hold on GPUs that are unhealthy or gone, so what is left is the healthy GPUs' room."""
    pods = [_on(_pod("on-b", [_slice("c", 1, 61440, 30)]), c="GPU-bbbb"),
            _on(_pod("on-a", [_slice("c", 1, 10240, 20)]), c="GPU-aaaa"),
            # two GPUs, one of them failed: half its slice is on the failed one
            _on(_pod("both", [_slice("c", 2, 4096, 10)]), c="GPU-aaaa,GPU-bbbb"),
            _on(_pod("gone", [_slice("c", 1, 2048, 5)]), c="GPU-cccc"),  # fell off the bus
            _on(_pod("done", [_slice("c", 1, 8192, 50)], phase="Succeeded"), c="GPU-bbbb")]
    async with FakeKube() as kube:
        kube.put(_node())
        for p in pods:
            kube.put(p)
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            await pub.publish(TWO)
            node = kube.get("nodes", "gpu-node-1")
            # reset, all back: the totals of the three GPUs again
            back = Discovery(True, (A, Gpu("GPU-bbbb", 1, A.product, 81920, HEALTHY),
                                    Gpu("GPU-cccc", 2, A.product, 81920, HEALTHY)))
            await pub.publish(back)
            assert kube.get("nodes", "gpu-node-1")["status"]["allocatable"] == {
                **node["status"]["allocatable"], "nvidia.com/gpu": "30",
                "nvidia.com/gpumem": str(3 * 81920), "nvidia.com/gpucores": "300"}
    live = [p for p in pods if p["status"]["phase"] == "Running"]
    # GPU-aaaa holds on-a and half of both: 10 - 2 slices, 81920 - 10240 - 2048, 100 - 20 - 5
    assert await _free(node, live) == {"nvidia.com/gpu": 8, "nvidia.com/gpumem": 69632,
                                 "nvidia.com/gpucores": 75}
    assert node["status"]["capacity"] == {**node["status"]["capacity"], "nvidia.com/gpu": "13",
                                          "nvidia.com/gpumem": str(81920 + 61440 + 2048 + 2048),
                                          "nvidia.com/gpucores": str(100 + 30 + 5 + 5)}


async def test_a_restarted_agent_without_nvml_keeps_what_running_pods_hold() -> None:
    """The host's driver was upgraded under running pods (NVML: LIB_RM_VERSION_MISMATCH) and
    the agent restarted: the GPUs of the last annotation are gone from its view, the pods on
    them still run; the totals stay at what they hold, so nothing new fits and a restarted
    kubelet admits them again."""
    async with FakeKube() as kube:
        node = _node()
        node["metadata"]["annotations"] = {"gpuslice.io/gpus": ANNOTATION}
        kube.put(node)
        kube.put(_on(_pod("on-a", [_slice("c", 1, 10240, 20)]), c="GPU-aaaa"))
        none = Discovery(available=False, reason="NVML initialisation failed")
        async with kube.api_client() as api:
            for _ in range(2):  # restarted again: the annotation no longer names the GPUs
                await Publisher(api, SETTINGS).publish(none)
                got = kube.get("nodes", "gpu-node-1")
                assert got["metadata"]["annotations"]["gpuslice.io/gpus"] == "[]"
                assert {k: v for k, v in got["status"]["allocatable"].items()
                        if "nvidia" in k} == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10240",
                                              "nvidia.com/gpucores": "20"}
            kube.delete("pods", "on-a", "ml")
            pub = Publisher(api, SETTINGS)
            await pub.publish(none)
            assert kube.get("nodes", "gpu-node-1")["status"]["capacity"]["nvidia.com/gpu"] == "0"
            n = len(kube.requests)
            await pub.publish(none)  # zeros now: the node is read, its pods no more
            assert len(kube.requests) == n + 1


async def test_a_gpu_turned_unhealthy_is_published_so_even_when_the_pods_cannot_be_listed(
        ) -> None:
    """GPU-bbbb failed: the totals wait for the node's pods (what they hold on it), but its
    Unhealthy mark, by which the extender places nothing more on it, does not: the API server
    refusing the pod list (throttled, its watch cache not ready) must not keep new pods going
    onto a failed GPU. The round still fails, and is retried, for the totals."""
    healthy = Discovery(True, (A, Gpu("GPU-bbbb", 1, A.product, 81920, HEALTHY)), "550")
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            pub = Publisher(api, SETTINGS)
            await pub.publish(healthy)
            kube.fail("GET", r"^/api/v1/pods$", 429, times=2)
            for _ in range(2):
                with pytest.raises(client.ApiException):
                    await pub.publish(TWO)
                node = kube.get("nodes", "gpu-node-1")
                assert node["metadata"]["annotations"]["gpuslice.io/gpus"] == ANNOTATION
            assert len(kube.requests_to("PATCH", r"/nodes/gpu-node-1$")) == 2  # no more
            assert node["status"]["capacity"]["nvidia.com/gpu"] == "20"  # until they can
            await pub.publish(TWO)
            assert kube.get("nodes", "gpu-node-1")["status"]["capacity"]["nvidia.com/gpu"] == "10"
