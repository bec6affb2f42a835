"""The agent's metrics: per GPU from NVML, per container from region files (incl. bad ones)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from node.fakenvml import GIB, FakeNvml, two_a100s
from node.test_liveness import fake_process
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from webhook import __version__
from webhook.node.inventory import Inventory
from webhook.node.metrics import AgentCollector, AgentStatus, make_registry
from webhook.node.region import DeviceSlot, ProcessUsage, Region, encode_region, read_region

UID1 = "0f0e0d0c-0b0a-0908-0706-050403020100"
UID2 = "11111111-2222-3333-4444-555555555555"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def write_region(state: Path, uid: str, pod: str, ns: str, ctr: str,
                 devices: list[tuple[int, str, int, int, int, int]], scale: int = 0) -> Path:
    slots = tuple(DeviceSlot(index=i, uuid=u, limit_bytes=lim, used_bytes=used, sm_limit=sm,
                             busy_ns=busy, sm_scale_milli=scale)
                  for i, u, lim, used, sm, busy in devices)
    region = Region(pod_uid=uid, pod_name=pod, namespace=ns, container=ctr, devices=slots,
                    processes=(ProcessUsage(pid=100, used_bytes=tuple(d[3] for d in devices)),))
    path = state / uid / ctr / "region"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_region(region))
    return path


def samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def ctr_labels(ns: str, pod: str, uid: str, ctr: str, uuid: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": ns, "pod": pod, "pod_uid": uid, "container": ctr,
                         "uuid": uuid}.items()))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(state: Path, nvml: FakeNvml | None = None, clock: Clock | None = None):
    inv = Inventory(nvml or two_a100s())
    inv.discover()
    collector = AgentCollector(inv, state, AgentStatus(library="libgpuslice.so.0.1.0"),
                               clock=clock or Clock())
    return collector, make_registry(collector)


def test_gpu_metrics_come_from_nvml(tmp_path: Path) -> None:
    _, reg = make(tmp_path)
    s = samples(reg)
    lab0 = (("index", "0"), ("product", "NVIDIA A100-SXM4-80GB"), ("uuid", GPU0))
    assert s[("gpuslice_gpu_memory_used_bytes", lab0)] == 5 * GIB
    assert s[("gpuslice_gpu_memory_total_bytes", lab0)] == 80 * GIB
    assert s[("gpuslice_gpu_utilization_percent", lab0)] == 40
    assert s[("gpuslice_gpu_healthy", lab0)] == 1
    assert s[("gpuslice_nvml_available", ())] == 1


def test_an_unhealthy_gpu_says_why(tmp_path: Path) -> None:
    nvml = two_a100s()
    nvml.devices[1].mig = (1, 1)
    _, reg = make(tmp_path, nvml)
    s = samples(reg)
    lab1 = (("index", "1"), ("product", "NVIDIA A100-SXM4-80GB"), ("uuid", GPU1))
    assert s[("gpuslice_gpu_healthy", lab1)] == 0
    reasons = {k: v for k, v in s.items() if k[0] == "gpuslice_gpu_unhealthy_reason"}
    assert len(reasons) == 1
    (_, labels), value = next(iter(reasons.items()))
    assert value == 1 and dict(labels)["uuid"] == GPU1
    assert dict(labels)["reason"].startswith("MIG mode is enabled")


def test_container_metrics_per_device_from_region_files(tmp_path: Path) -> None:
    write_region(tmp_path, UID1, "trainer-0", "ml", "main",
                 [(0, GPU0, 10 * GIB, 3 * GIB, 30, 0), (1, GPU1, 10 * GIB, 1 * GIB, 0, 0)])
    write_region(tmp_path, UID2, "web", "serving", "app", [(0, GPU0, 4 * GIB, 0, 100, 0)])
    _, reg = make(tmp_path)
    s = samples(reg)
    m = ctr_labels("ml", "trainer-0", UID1, "main", GPU0)
    assert s[("gpuslice_container_memory_used_bytes", m)] == 3 * GIB
    assert s[("gpuslice_container_memory_limit_bytes", m)] == 10 * GIB
    assert s[("gpuslice_container_compute_limit_percent", m)] == 30
    m1 = ctr_labels("ml", "trainer-0", UID1, "main", GPU1)
    assert s[("gpuslice_container_memory_used_bytes", m1)] == 1 * GIB
    assert s[("gpuslice_container_compute_limit_percent", m1)] == 100  # 0 = not throttled
    w = ctr_labels("serving", "web", UID2, "app", GPU0)
    assert s[("gpuslice_container_memory_limit_bytes", w)] == 4 * GIB
    assert s[("gpuslice_region_errors_total", ())] == 0


def test_rows_naming_a_gpu_the_node_does_not_have_are_not_exported(tmp_path: Path) -> None:
    # the container's processes can write any UUID into its region: one writing new ones at
    # each scrape made a new series each time (8,000 in 100 scrapes from one container)
    _, reg = make(tmp_path)
    for n in range(50):
        write_region(tmp_path, UID1, "trainer-0", "ml", "main",
                     [(0, GPU0, 10 * GIB, 3 * GIB, 30, 0),
                      (1, f"GPU-{n:08x}-0000-0000-0000-000000000000", 10 * GIB, GIB, 0, 0)])
        s = samples(reg)
        uuids = {dict(labels)["uuid"] for name, labels in s
                 if name == "gpuslice_container_memory_used_bytes"}
        assert uuids == {GPU0}
    assert s[("gpuslice_container_memory_used_bytes", ctr_labels("ml", "trainer-0", UID1, "main",
                                                                 GPU0))] == 3 * GIB
    # before the first discovery (or without NVML) there is no list to hold them to
    undiscovered = AgentCollector(Inventory(two_a100s()), tmp_path, AgentStatus())
    s = samples(make_registry(undiscovered))
    assert {dict(labels)["uuid"] for name, labels in s
            if name == "gpuslice_container_memory_used_bytes"} == {GPU0, "GPU-00000031-0000-0000-0000-000000000000"}


def test_a_region_naming_one_gpu_twice_exports_one_series_per_label_set(
        tmp_path: Path) -> None:
    # the library keeps one device slot per GPU, but every process of the container can
    # write its region: a second slot with the same UUID repeated each container series
    # (the same labels twice in one scrape), which Prometheus drops as duplicates
    write_region(tmp_path, UID1, "trainer-0", "ml", "main",
                 [(0, GPU0, 10 * GIB, 3 * GIB, 30, 0), (1, GPU0, 20 * GIB, GIB, 50, 0)])
    _, reg = make(tmp_path)
    text = generate_latest(reg).decode()
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines()
              if line and not line.startswith("#")]
    assert len(series) == len(set(series))
    s = samples(reg)
    m = ctr_labels("ml", "trainer-0", UID1, "main", GPU0)
    assert s[("gpuslice_container_memory_limit_bytes", m)] == 10 * GIB  # the first slot
    assert s[("gpuslice_container_compute_limit_percent", m)] == 30


def test_measured_share_is_the_busy_time_rate_between_scrapes(tmp_path: Path) -> None:
    clock = Clock()
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 5_000_000_000)])
    _, reg = make(tmp_path, clock=clock)
    lab = ctr_labels("ns", "p", UID1, "c", GPU0)
    first = samples(reg)
    assert ("gpuslice_container_compute_share_percent", lab) not in first  # no interval yet
    assert first[("gpuslice_container_busy_seconds_total", lab)] == 5.0
    clock.t += 10.0  # 10 s later the container had the GPU busy for 3 s more: 30%
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 8_000_000_000)])
    assert samples(reg)[("gpuslice_container_compute_share_percent", lab)] == pytest.approx(30.0)
    clock.t += 10.0  # idle since: 0 %, not a missing figure
    assert samples(reg)[("gpuslice_container_compute_share_percent", lab)] == 0.0
    clock.t += 10.0  # container restarted: the counter went back, no bogus rate
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 1_000_000_000)])
    assert ("gpuslice_container_compute_share_percent", lab) not in samples(reg)


def test_no_share_across_a_replaced_region(tmp_path: Path) -> None:
    # a region replaced at its path (an older library's file unlinked and made again, or the
    # tenant's rm): its counter starts over, and the old file's made no rate with it.  1 s
    # counted in the old file, 9 s in the new one 10 s later: the share read 80 %
    clock = Clock()
    path = write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 1_000_000_000)])
    _, reg = make(tmp_path, clock=clock)
    lab = ctr_labels("ns", "p", UID1, "c", GPU0)
    samples(reg)
    clock.t += 10.0
    new = Region(UID1, "p", "ns", "c", (DeviceSlot(0, GPU0, GIB, 0, 30, 9_000_000_000),), ())
    staged = path.with_name("region.new")
    staged.write_bytes(encode_region(new))
    os.rename(staged, path)
    assert ("gpuslice_container_compute_share_percent", lab) not in samples(reg)
    clock.t += 10.0  # 3 s more in the new file: 30 %
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 12_000_000_000)])
    assert samples(reg)[("gpuslice_container_compute_share_percent", lab)] == pytest.approx(30.0)


def test_clock_scale_is_exported_for_limited_devices_only(tmp_path: Path) -> None:
    write_region(tmp_path, UID1, "p", "ns", "c",
                 [(0, GPU0, GIB, 0, 30, 0), (1, GPU1, GIB, 0, 0, 0)], scale=1314)
    write_region(tmp_path, UID2, "q", "ns", "c", [(0, GPU0, GIB, 0, 50, 0)])  # not estimated yet
    write_region(tmp_path, "33333333-2222-3333-4444-555555555555", "r", "ns", "c",
                 [(0, GPU0, GIB, 0, 100, 0)], scale=1314)  # 100 %: no limit, nothing to scale
    s = samples(make(tmp_path)[1])
    assert ("gpuslice_container_compute_clock_scale",
            ctr_labels("ns", "r", "33333333-2222-3333-4444-555555555555", "c", GPU0)) not in s
    assert s[("gpuslice_container_compute_clock_scale", ctr_labels("ns", "p", UID1, "c", GPU0))] == 1.314
    assert ("gpuslice_container_compute_clock_scale", ctr_labels("ns", "p", UID1, "c", GPU1)) not in s
    assert s[("gpuslice_container_compute_clock_scale", ctr_labels("ns", "q", UID2, "c", GPU0))] == 1.0


def test_corrupt_and_truncated_regions_are_skipped_counted_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 0)])
    bad = tmp_path / UID2 / "c" / "region"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x00garbage" * 10)
    truncated = tmp_path / "22222222-2222-3333-4444-555555555555" / "c" / "region"
    truncated.parent.mkdir(parents=True)
    truncated.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    _, reg = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="webhook.node.metrics"):
        first = samples(reg)
        second = samples(reg)
    assert first[("gpuslice_region_errors_total", ())] == 2
    assert second[("gpuslice_region_errors_total", ())] == 4
    assert first[("gpuslice_container_memory_limit_bytes", ctr_labels("ns", "p", UID1, "c", GPU0))] \
        == GIB
    logged = [r for r in caplog.records if r.message == "unreadable region file skipped"]
    assert sorted(r.path for r in logged) == sorted([str(bad), str(truncated)])


def test_container_without_region_file_yet_is_not_an_error(tmp_path: Path) -> None:
    (tmp_path / UID1 / "c").mkdir(parents=True)
    _, reg = make(tmp_path)
    s = samples(reg)
    assert s[("gpuslice_region_errors_total", ())] == 0
    assert not any(name.startswith("gpuslice_container_") for name, _ in s)


def test_without_driver_metrics_say_nvml_unavailable_and_still_render(tmp_path: Path) -> None:
    import pynvml
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 0)])
    _, reg = make(tmp_path, FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    s = samples(reg)
    assert s[("gpuslice_nvml_available", ())] == 0
    assert not any(name.startswith("gpuslice_gpu_memory") for name, _ in s)
    assert s[("gpuslice_container_memory_limit_bytes", ctr_labels("ns", "p", UID1, "c", GPU0))] == GIB


def test_agent_status_metrics(tmp_path: Path) -> None:
    _, reg = make(tmp_path)
    s = samples(reg)
    assert s[("gpuslice_agent_info", (("library", "libgpuslice.so.0.1.0"),
                                      ("version", __version__)))] == 1
    assert s[("gpuslice_agent_publish_errors_total", ())] == 0
    # an agent that has not cleaned up yet is blocked by nothing, and NVML is not hung
    assert s[("gpuslice_agent_library_cleanup_blocked", ())] == 0
    assert s[("gpuslice_nvml_hung", ())] == 0


def test_a_region_file_vanishing_mid_scrape_is_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from webhook.node import metrics
    from webhook.node.region import RegionError
    write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 0)])

    def vanished(path: object) -> None:
        raise RegionError("cannot read region") from FileNotFoundError(2, "gone")

    monkeypatch.setattr(metrics, "read_region", vanished)
    _, reg = make(tmp_path)
    assert samples(reg)[("gpuslice_region_errors_total", ())] == 0


@pytest.mark.parametrize("claims", ["another pod", "another container"])
def test_a_region_claiming_another_identity_is_labelled_by_its_directory(
        tmp_path: Path, claims: str) -> None:
    # every process of a container can write its region: the names in it are believed only
    # where its pod UID and container are those of the dirs kubelet made for the container
    path = write_region(tmp_path, UID1, "victim", "prod", "c", [(0, GPU0, GIB, 0, 30, 0)])
    fake_uid, fake_ctr = (UID2, "c") if claims == "another pod" else (UID1, "other")
    path.write_bytes(encode_region(Region(
        pod_uid=fake_uid, pod_name="victim", namespace="prod", container=fake_ctr,
        devices=(DeviceSlot(index=0, uuid=GPU0, limit_bytes=GIB, used_bytes=0, sm_limit=30,
                            busy_ns=0),),
        processes=())))
    _, reg = make(tmp_path)
    s = samples(reg)
    assert s[("gpuslice_container_memory_limit_bytes", ctr_labels("", UID1, UID1, "c", GPU0))] \
        == GIB
    assert not [k for k in s if ("namespace", "prod") in k[1]]


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_region_path_that_is_not_a_plain_file_is_not_followed_or_waited_on(
        tmp_path: Path, kind: str) -> None:
    from webhook.node.region import RegionError, read_region
    elsewhere = write_region(tmp_path / "elsewhere", UID2, "q", "ns", "c",
                             [(0, GPU0, GIB, 0, 30, 0)])
    path = tmp_path / "state" / UID1 / "c" / "region"
    path.parent.mkdir(parents=True)
    if kind == "symlink":
        path.symlink_to(elsewhere)  # the agent reads as root: the link's target is not the region
    else:
        os.mkfifo(path)  # opening it would wait for a writer
    with pytest.raises(RegionError, match="a symbolic link" if kind == "symlink" else
                       "not a plain file"):
        read_region(path)
    _, reg = make(tmp_path / "state")
    s = samples(reg)
    assert not [k for k in s if k[0] == "gpuslice_container_memory_limit_bytes"]
    assert s[("gpuslice_region_errors_total", ())] == (1 if kind == "symlink" else 0)


def test_names_come_from_the_api_servers_list_not_from_the_region(tmp_path: Path) -> None:
    # the region is the container's to write: it claims to be kube-system's coredns
    write_region(tmp_path, UID1, "coredns-5d78c9869d-abcde", "kube-system", "c",
                 [(0, GPU0, GIB, 0, 30, 0)])
    write_region(tmp_path, UID2, "web", "serving", "app", [(0, GPU0, GIB, 0, 30, 0)])
    collector, reg = make(tmp_path)
    collector.pod_names = {UID1: ("ml", "trainer-0")}  # the agent's last list of the node's pods
    s = samples(reg)
    assert s[("gpuslice_container_memory_limit_bytes",
              ctr_labels("ml", "trainer-0", UID1, "c", GPU0))] == GIB
    assert not [k for k in s if ("namespace", "kube-system") in k[1]]
    # a pod not listed yet keeps its region's names (its identity is its dirs')
    assert s[("gpuslice_container_memory_limit_bytes",
              ctr_labels("serving", "web", UID2, "app", GPU0))] == GIB


def test_a_departed_pods_region_does_not_take_its_successors_names(tmp_path: Path) -> None:
    # StatefulSet pod web-0 deleted and made again under a new UID: the old pod's dir stays
    # until the clean-up's grace (600 s), and its region's names stood in for the API server's
    # (it is not listed): both UIDs were exported as prod/web-0, their limits summed twice
    from webhook.node.metrics import LISTED_MARGIN_S
    write_region(tmp_path, UID1, "web-0", "prod", "app", [(0, GPU0, 8 * GIB, 0, 50, 0)])
    write_region(tmp_path, UID2, "web-0", "prod", "app", [(0, GPU0, 8 * GIB, 0, 50, 0)])
    collector, reg = make(tmp_path)
    collector.pod_names = {UID2: ("prod", "web-0")}
    collector.pod_names_at = time.time() + 2 * LISTED_MARGIN_S  # a list well after the old dir
    s = samples(reg)
    limits = {dict(labels)["pod_uid"]: (dict(labels)["namespace"], dict(labels)["pod"])
              for name, labels in s if name == "gpuslice_container_memory_limit_bytes"}
    assert limits == {UID2: ("prod", "web-0"), UID1: ("", UID1)}
    # a list begun before the dir's last change: the pod may be too new for it, its names stand
    collector.pod_names_at = time.time() - 2 * LISTED_MARGIN_S
    s = samples(reg)
    assert s[("gpuslice_container_memory_limit_bytes", ctr_labels("prod", "web-0", UID1, "app", GPU0))] == 8 * GIB


def _set_changed(pod_dir: Path, when: int) -> None:
    """The pod dir and its container dirs last changed at ``when`` (as ``last_change`` reads
    them: the earlier of mtime and ctime, and ctime is now)."""
    for d in (pod_dir, *(c for c in pod_dir.iterdir() if c.is_dir())):
        os.utime(d, ns=(when * 10**9, when * 10**9))


def test_a_pod_dir_is_departed_only_past_the_margin_before_the_list(tmp_path: Path) -> None:
    # the list comes from the watch cache, which may lag the kubelet's start of a pod by
    # seconds: a dir changed within LISTED_MARGIN_S before the list began may be a pod too new
    # for it, and keeps its region's names; one unchanged since well before is a departed pod's
    from webhook.node.metrics import LISTED_MARGIN_S
    path = write_region(tmp_path, UID1, "web-0", "prod", "app", [(0, GPU0, GIB, 0, 50, 0)])
    changed = int(time.time()) - 3600
    _set_changed(path.parent.parent, changed)
    collector, reg = make(tmp_path)
    collector.pod_names = {UID2: ("prod", "other")}
    named = ("gpuslice_container_memory_limit_bytes", ctr_labels("prod", "web-0", UID1, "app", GPU0))
    anonymous = ("gpuslice_container_memory_limit_bytes", ctr_labels("", UID1, UID1, "app", GPU0))
    for list_began, departed in [(changed + LISTED_MARGIN_S - 1, False), (changed + LISTED_MARGIN_S, False),
                                 (changed + LISTED_MARGIN_S + 1, True), (changed + 1, False)]:
        collector.pod_names_at = list_began
        s = samples(reg)
        assert (anonymous in s, named in s) == (departed, not departed), list_began - changed


def test_a_pod_dir_whose_age_cannot_be_read_is_not_taken_for_departed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the dir went between the region's read and its age's (the clean-up, or the kubelet)
    from webhook.node import metrics
    write_region(tmp_path, UID1, "web-0", "prod", "app", [(0, GPU0, GIB, 0, 50, 0)])
    collector, reg = make(tmp_path)
    collector.pod_names = {UID2: ("prod", "other")}
    collector.pod_names_at = time.time() + 3600

    def gone(path: Path) -> float:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(metrics, "last_change", gone)
    assert samples(reg)[("gpuslice_container_memory_limit_bytes",
                         ctr_labels("prod", "web-0", UID1, "app", GPU0))] == GIB


def test_a_region_that_reads_again_is_logged_again_when_it_breaks_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 0)])
    good = path.read_bytes()
    _, reg = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="webhook.node.metrics"):
        for content in (b"\x00garbage" * 10, b"\x00garbage" * 10, good, b"\x00garbage" * 10):
            path.write_bytes(content)
            samples(reg)
    logged = [r for r in caplog.records if r.message == "unreadable region file skipped"]
    assert len(logged) == 2  # once per episode, not per scrape


def test_files_that_are_not_plain_are_never_opened(tmp_path: Path) -> None:
    from webhook.node.files import NotPlainFile, read_plain_file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/null"), "a character device"),
                       (tmp_path, "a directory")):
        with pytest.raises(NotPlainFile, match=kind):
            read_plain_file(path, 10)
    plain = tmp_path / "plain"
    plain.write_bytes(b"0123456789")
    link = tmp_path / "link"
    link.symlink_to(plain)
    assert read_plain_file(plain, 4) == b"0123"
    assert read_plain_file(link, 100) == b"0123456789"
    with pytest.raises(NotPlainFile, match="a symbolic link"):
        read_plain_file(link, 100, follow=False)


def test_a_scrape_reads_one_audit_report_while_checks_replace_it(tmp_path: Path) -> None:
    # The scrape runs in a worker thread, the checks on the event loop: each check replaces
    # auditor.last. A scrape that read it once per family mixed two checks' figures (the
    # memory of one, the compute share and the GPU's unattributed share of the next).
    from webhook.node.audit import AuditReport as Report
    from webhook.node.audit import Cap, Holding, Load, Tracked

    t = Tracked("ns", "p", UID1, "c", Cap(limit_bytes=GIB), cores=30)
    over = Report(holdings=(Holding(t, ("a" * 64,), GPU0, 2 * GIB, GIB, (7,)),),
                  loads=(Load(t, ("a" * 64,), GPU0, 80.0, 30, 60.0, True, (7,)),),
                  unattributed={GPU0: 0}, complete=True, compute_unattributed={GPU0: 15.0})
    gone = Report(unattributed={GPU0: 0}, complete=True, compute_unattributed={GPU0: 95.0})

    class Compute:
        failures = 0

    class Checking:
        """An auditor whose checks land between any two reads of its report."""

        tolerance, compute_tolerance, compute = 0, 10.0, Compute()
        errors = episodes = evictions = 0

        def __init__(self) -> None:
            self.reads = 0

        @property
        def last(self) -> Report:
            self.reads += 1
            return over if self.reads % 2 else gone

    inv = Inventory(two_a100s())
    inv.discover()
    for _ in range(2):  # whichever report the scrape begins with
        auditor = Checking()
        auditor.reads += _
        reg = make_registry(AgentCollector(inv, tmp_path, AgentStatus(), clock=Clock(),
                                           auditor=auditor))  # type: ignore[arg-type]
        s = samples(reg)
        lab = ctr_labels("ns", "p", UID1, "c", GPU0)
        memory = s.get(("gpuslice_container_memory_observed_bytes", lab))
        compute = s.get(("gpuslice_container_compute_observed_percent", lab))
        other = s[("gpuslice_gpu_compute_unattributed_percent", (("uuid", GPU0),))]
        assert (memory, compute, other) in ((2 * GIB, 80.0, 15.0), (None, None, 95.0))


def test_audit_metrics_per_container_label_set_and_per_gpu(tmp_path: Path) -> None:
    # a fixed report: a container over its cap (a restarted one: two instances' IDs), one
    # under it, what no gpuslice container holds per GPU, and compute loads over, under and
    # not judged
    from webhook.node.audit import AuditReport, Cap, Holding, Load, Tracked

    a = Tracked("ns", "a", UID1, "c", Cap(limit_bytes=GIB), cores=30)
    b = Tracked("ns", "b", UID2, "c", Cap(limit_bytes=GIB), cores=50)
    report = AuditReport(
        holdings=(Holding(a, ("new", "old"), GPU0, 1300 * 2**20, GIB, (7, 8)),
                  Holding(b, ("b",), GPU0, 900 * 2**20, GIB, (9,))),
        loads=(Load(a, ("new", "old"), GPU0, 45.0, 30, 60.0, True, (7, 8)),
               Load(b, ("b",), GPU0, 40.0, 50, 60.0, True, (9,)),
               Load(b, ("b",), GPU1, 90.0, 50, 5.0, False, (9,))),
        unattributed={GPU0: 3 * 2**20, GPU1: 0}, complete=True,
        compute_unattributed={GPU0: 12.345, GPU1: 0.0})

    class Compute:
        failures = 2

    class Fixed:
        tolerance, compute_tolerance, compute = 0, 5.0, Compute()
        errors, episodes, evictions, last = 1, 3, 0, report

    inv = Inventory(two_a100s())
    inv.discover()
    s = samples(make_registry(AgentCollector(inv, tmp_path, AgentStatus(last_audit=1234.0),
                                             clock=Clock(), auditor=Fixed())))  # type: ignore[arg-type]
    la, lb = ctr_labels("ns", "a", UID1, "c", GPU0), ctr_labels("ns", "b", UID2, "c", GPU0)
    lb1 = ctr_labels("ns", "b", UID2, "c", GPU1)
    got = {k: v for k, v in s.items() if k[0].startswith(("gpuslice_container_memory_o",
                                                           "gpuslice_container_compute_o",
                                                           "gpuslice_container_compute_j",
                                                           "gpuslice_gpu_memory_unattributed",
                                                           "gpuslice_gpu_compute_unattributed"))}
    assert got == {
        ("gpuslice_container_memory_observed_bytes", la): 1300 * 2**20,
        ("gpuslice_container_memory_over_limit", la): 1,
        ("gpuslice_container_memory_observed_bytes", lb): 900 * 2**20,
        ("gpuslice_container_memory_over_limit", lb): 0,
        ("gpuslice_gpu_memory_unattributed_bytes", (("uuid", GPU0),)): 3 * 2**20,
        ("gpuslice_gpu_memory_unattributed_bytes", (("uuid", GPU1),)): 0,
        ("gpuslice_container_compute_observed_percent", la): 45.0,
        ("gpuslice_container_compute_over_limit", la): 1,
        ("gpuslice_container_compute_judged", la): 1,
        ("gpuslice_container_compute_observed_percent", lb): 40.0,
        ("gpuslice_container_compute_over_limit", lb): 0,
        ("gpuslice_container_compute_judged", lb): 1,
        ("gpuslice_container_compute_observed_percent", lb1): 90.0,  # a figure, not judged
        ("gpuslice_container_compute_over_limit", lb1): 0,
        ("gpuslice_container_compute_judged", lb1): 0,
        ("gpuslice_gpu_compute_unattributed_percent", (("uuid", GPU0),)): 12.35,
        ("gpuslice_gpu_compute_unattributed_percent", (("uuid", GPU1),)): 0.0,
    }
    assert (s[("gpuslice_agent_audit_complete", ())], s[("gpuslice_agent_last_audit_timestamp_seconds", ())],
            s[("gpuslice_agent_audit_errors_total", ())], s[("gpuslice_agent_over_limit_events_total", ())],
            s[("gpuslice_agent_evictions_total", ())], s[("gpuslice_agent_compute_sample_errors_total", ())]) \
        == (1, 1234.0, 1, 3, 0, 2)


def test_a_region_being_initialised_is_not_an_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A container's first process creates the file (0 bytes), sizes it (zeros), writes the
    # fields and the magic last, under the file's flock, which the agent does not take; a
    # region from an earlier boot is reset the same way. A scrape meeting either was counted
    # as a corrupt region and logged.
    from webhook.node.region import RegionError, RegionNotReady, parse_region
    good = write_region(tmp_path, UID1, "p", "ns", "c", [(0, GPU0, GIB, 0, 30, 0)])
    created = tmp_path / UID2 / "c" / "region"
    created.parent.mkdir(parents=True)
    created.write_bytes(b"")
    midway = tmp_path / "22222222-2222-3333-4444-555555555555" / "c" / "region"
    midway.parent.mkdir(parents=True)
    midway.write_bytes(bytes(8) + good.read_bytes()[8:])  # every field but the magic
    for path in (created, midway):
        with pytest.raises(RegionNotReady):
            parse_region(path.read_bytes())
    with pytest.raises(RegionError, match="bad magic"):  # a corrupt one still is one
        parse_region(b"\x01" + bytes(7) + good.read_bytes()[8:])
    _, reg = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="webhook.node.metrics"):
        s = samples(reg)
    assert s[("gpuslice_region_errors_total", ())] == 0
    assert not [r for r in caplog.records if r.message == "unreadable region file skipped"]
    assert s[("gpuslice_container_memory_limit_bytes", ctr_labels("ns", "p", UID1, "c", GPU0))] \
        == GIB
    assert [k for k in s if k[0] == "gpuslice_container_memory_limit_bytes"] == \
        [("gpuslice_container_memory_limit_bytes", ctr_labels("ns", "p", UID1, "c", GPU0))]


# ---- memory of processes that died without their exit handlers ---------------------------

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "interposer" / "build"
UUID_A = GPU0  # the fake driver's device is the node's first GPU (rows of others are not exported)
MIB = 1 << 20


@pytest.fixture(scope="module")
def library() -> Path:
    """The interposer, the fake driver and NVML, and the probe (interposer/tests)."""
    targets = ["build/libgpuslice.so", "build/fake/libcuda.so.1", "build/fake/libnvidia-ml.so.1",
               "build/tests/gsprobe"]
    proc = subprocess.run(["make", "-s", "-C", str(ROOT / "interposer"), *targets], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return BUILD


class Container:
    """Processes of one container (UID1/main) running gsprobe under the library, their region
    in the agent's state dir."""

    def __init__(self, build: Path, state: Path, tmp: Path) -> None:
        self.region = state / UID1 / "main" / "region"
        self.region.parent.mkdir(parents=True)
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("CUDA_", "GPUSLICE_", "FAKE_", "LIBCUDA_", "LD_"))}
        self.env.update(LD_PRELOAD=str(build / "libgpuslice.so"),
                        LD_LIBRARY_PATH=str(build / "fake"),
                        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.region),
                        CUDA_DEVICE_MEMORY_LIMIT="2g", FAKE_CUDA_STATE=str(tmp / "fakestate"),
                        FAKE_CUDA_DEVICES=f"{UUID_A}=16g", LIBCUDA_LOG_LEVEL="1")
        self.probe = str(build / "tests" / "gsprobe")
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, *cmds: str) -> None:
        proc = subprocess.run([self.probe, *cmds], env=self.env, capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def start(self, *cmds: str) -> subprocess.Popen[bytes]:
        """A probe running ``cmds``, then holding on until :meth:`release`."""
        held = self.tmp / f"held{len(self.procs)}"
        proc = subprocess.Popen([self.probe, *cmds, "touch", str(held), "waitfile",
                                 str(self.tmp / "go")], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while not held.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        return proc

    def release(self) -> None:
        (self.tmp / "go").touch()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def charged(self) -> int:
        return read_region(self.region).devices[0].used_bytes


@pytest.fixture
def container(library: Path, tmp_path: Path) -> Iterator[Container]:
    ctr = Container(library, tmp_path / "state", tmp_path)
    yield ctr
    ctr.release()


def used_of(reg, uid: str = UID1, uuid: str = UUID_A) -> float:
    [value] = [v for (name, labels), v in samples(reg).items()
               if name == "gpuslice_container_memory_used_bytes"
               and dict(labels)["pod_uid"] == uid and dict(labels)["uuid"] == uuid]
    return value


def proc_state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


@pytest.mark.parametrize("death", ["_exit", "sigkill", "zombie"])
def test_memory_of_a_process_gone_without_its_exit_handlers_is_not_counted(
        container: Container, tmp_path: Path, death: str) -> None:
    # The reviewer's probe: 768 MiB allocated, then an exit without handlers. The slot stays
    # live in the region until another process of the container starts and sweeps it; the
    # agent showed its 768 MiB as used with no process alive (for ever, in a finished Job pod).
    collector, reg = make(tmp_path / "state")
    if death == "_exit":
        container.run("init", "ctx", "0", "alloc", "768m", "exit", "0")
    else:
        proc = container.start("init", "ctx", "0", "alloc", "768m")
        assert container.charged() >= 768 * MIB
        assert used_of(reg) == container.charged()  # alive (its token held): counted
        proc.send_signal(signal.SIGKILL)
        if death == "zombie":  # killed, not reaped: its memory is gone all the same
            deadline = time.monotonic() + 10
            while proc_state(proc.pid) != "Z":
                assert time.monotonic() < deadline
                time.sleep(0.005)
        else:
            proc.wait()
    before = container.region.read_bytes()
    assert container.charged() >= 768 * MIB  # still in the region: nobody swept it
    assert used_of(reg) == 0
    assert used_of(reg) == 0  # (the verdict remembered)
    assert container.region.read_bytes() == before  # the agent never writes the region
    # the interposer's own sweep agrees: a process of the container starting reclaims it
    container.run("init", "ctx", "0")
    assert container.charged() == 0
    # and the agent forgets the dead process once no slot names it (a node's agent runs for
    # months: each process ever found dead kept otherwise)
    assert collector._liveness._dead
    assert used_of(reg) == 0
    assert not collector._liveness._dead


def test_a_live_process_that_closed_its_token_descriptor_is_still_counted(
        container: Container, tmp_path: Path) -> None:
    # A daemon's closefrom(3) closes the descriptor holding the slot's liveness token: the
    # process lives and holds its memory, and still maps the region (/proc/PID/maps).
    _, reg = make(tmp_path / "state")
    container.start("init", "ctx", "0", "alloc", "768m", "closefds")
    [slot] = read_region(container.region).processes
    assert slot.token == slot.pid and slot.token_held is False  # the cheap test fails
    assert container.charged() >= 768 * MIB
    assert used_of(reg) == container.charged()
    # a live process beside it, token held, changes nothing
    other = container.start("init", "ctx", "0", "alloc", "100m")
    assert [p.token_held for p in read_region(container.region).processes
            if p.pid == other.pid] == [True]
    assert used_of(reg) == container.charged() >= 868 * MIB
    container.release()
    assert used_of(reg) == container.charged() == 0  # exit handlers ran: slots freed


def test_a_process_that_exec_d_another_program_holds_nothing(
        container: Container, tmp_path: Path) -> None:
    # Same pid and start time, but exec took the token's descriptor and the mapping (and the
    # old image's memory): the sweep reclaims it, and the agent does not count it.
    _, reg = make(tmp_path / "state")
    container.start("init", "ctx", "0", "alloc", "768m", "reexec")
    assert container.charged() >= 768 * MIB
    assert used_of(reg) == 0
    container.run("init", "ctx", "0")  # the interposer's sweep agrees
    assert container.charged() == 0


def test_without_tokens_a_slot_is_judged_by_its_process_identity(tmp_path: Path) -> None:
    # No token noted (NFS, where the library takes none): the process is looked up by its pid,
    # PID namespace and start time; a region's process of a gone process is not counted, one
    # whose identity is not known (no /proc in its container) is.
    ns = os.stat("/proc/self/ns/pid").st_ino

    def start_of(pid: int) -> int:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rfind(")") + 1:].split()[19])

    child = subprocess.Popen(["sleep", "30"])
    child_start = start_of(child.pid)
    child.kill()
    child.wait()
    time.sleep(0.05)  # started a few clock ticks before the scrape: no later process can be it
    procs = (
        ProcessUsage(pid=os.getpid(), used_bytes=(1 * GIB,), pidns=ns,
                     start_time=start_of(os.getpid())),  # this test: alive
        ProcessUsage(pid=child.pid, used_bytes=(2 * GIB,), pidns=ns,
                     start_time=child_start),  # gone
        ProcessUsage(pid=os.getpid(), used_bytes=(4 * GIB,), pidns=ns,
                     start_time=start_of(os.getpid()) + 1),  # its pid, another start: gone
        ProcessUsage(pid=424242, used_bytes=(8 * GIB,), pidns=1,
                     start_time=child_start),  # another namespace, no such process: gone
        ProcessUsage(pid=child.pid, used_bytes=(16 * GIB,)),  # identity not known: counted
    )
    region = Region(pod_uid=UID1, pod_name="p", namespace="ns", container="c",
                    devices=(DeviceSlot(0, GPU0, 0, 31 * GIB, 0, 0),), processes=procs)
    path = tmp_path / UID1 / "c" / "region"
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_region(region))
    _, reg = make(tmp_path)
    assert used_of(reg, uuid=GPU0) == 17 * GIB
    # out of budget, what is not known yet counts (never under-report what may be held)
    from webhook.node.liveness import Liveness
    late = Liveness(budget=-1.0)
    late.begin()
    assert all(late.alive(p, 0) for p in read_region(path).processes)


def test_a_process_of_another_pid_namespace_is_found_by_its_identity(
        container: Container, tmp_path: Path) -> None:
    # As a pod's processes are to the agent: the slot's pid is its container's, the agent sees
    # the process under another pid. Its token descriptor closed, the agent finds it by the
    # start time, NSpid and ns/pid link, and counts it while it lives.
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if subprocess.run([*unshare, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot make a PID namespace here (needs root)")
    collector, reg = make(tmp_path / "state")
    container.probe, probe = unshare[0], container.probe
    proc = container.start(*unshare[1:], probe, "init", "ctx", "0", "alloc", "768m", "closefds")
    [slot] = read_region(container.region).processes
    assert slot.pid != proc.pid and slot.pidns != os.stat("/proc/self/ns/pid").st_ino
    assert slot.token_held is False
    assert container.charged() >= 768 * MIB
    assert used_of(reg) == container.charged()
    # found (not merely not known): its host pid, whose innermost pid is the slot's
    [(ident, host)] = collector._liveness._host.items()
    assert ident == (slot.pidns, slot.pid, slot.start_time)
    nspid = [ln for ln in Path(f"/proc/{host}/status").read_text().splitlines()
             if ln.startswith("NSpid:")]
    assert nspid == [f"NSpid:\t{host}\t{slot.pid}"]
    proc.send_signal(signal.SIGKILL)  # --kill-child: the namespace's processes go with it
    proc.wait()
    deadline = time.monotonic() + 10
    while used_of(reg) != 0:
        assert time.monotonic() < deadline, "the gone namespace's process still counted"
        time.sleep(0.05)
    assert container.charged() >= 768 * MIB


def test_a_process_started_after_the_scan_of_its_scrape_is_not_dead(tmp_path: Path) -> None:
    # One procfs scan per scrape indexes every process by start time. A process of container B
    # that started after the scan (and registered before B's region was read) was missing from
    # the index, judged gone, remembered dead, and its 2 GiB left out of every later scrape for
    # its whole life. A's process, started before the scan and not in it, is gone
    state, proc = tmp_path / "state", tmp_path / "proc"
    proc.mkdir()
    ticks = os.sysconf("SC_CLK_TCK")
    (proc / "uptime").write_text(f"{550 / ticks:.2f} 0.00\n")  # the scan: 550 ticks after boot
    fake_process(proc, 1, 1, 1, pidns=4026531836)
    for uid, pod, used, pid, pidns, start in ((UID1, "a", GIB, 7, 4026532001, 500),
                                                (UID2, "b", 2 * GIB, 9, 4026532002, 600)):
        region = Region(uid, pod, "ns", "c", (DeviceSlot(0, GPU0, 0, used, 0, 0),),
                        (ProcessUsage(pid=pid, used_bytes=(used,), pidns=pidns, start_time=start),))
        path = state / uid / "c" / "region"
        path.parent.mkdir(parents=True)
        path.write_bytes(encode_region(region))
    inv = Inventory(two_a100s())
    inv.discover()
    collector = AgentCollector(inv, state, AgentStatus(), proc_root=proc)
    reg = make_registry(collector)
    scan = collector._liveness._scan

    def scan_then_b_starts() -> dict[int, list[int]]:
        index = scan()
        if not (proc / "4242").exists():
            fake_process(proc, 4242, 9, 600, pidns=4026532002)
        return index

    collector._liveness._scan = scan_then_b_starts  # type: ignore[method-assign]
    assert used_of(reg, UID2, GPU0) == 2 * GIB  # not in the index, started after it: counted
    assert used_of(reg, UID1, GPU0) == 0  # not in it, started before it: gone
    collector._liveness._scan = scan  # type: ignore[method-assign]
    assert [used_of(reg, UID2, GPU0) for _ in range(3)] == [2 * GIB] * 3  # found: alive


def test_a_slot_read_mid_registration_is_not_judged_dead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The library registers a process in a slot with relaxed stores (pid, pidns, start time,
    # token, then the state), and the agent reads the file without the region's lock: on
    # aarch64 a read may see the slot live with the new pid and its first charge but the start
    # time of the dead process that had the slot before, and no token yet. Looked up, that
    # identity is gone: the live process's memory was taken off the container's usage.
    ns = os.stat("/proc/self/ns/pid").st_ino
    text = Path(f"/proc/{os.getpid()}/stat").read_text()
    started = int(text[text.rfind(")") + 1:].split()[19])

    def region(start: int) -> bytes:
        me = ProcessUsage(pid=os.getpid(), used_bytes=(1 * GIB,), pidns=ns, start_time=start)
        return encode_region(Region(pod_uid=UID1, pod_name="p", namespace="ns", container="c",
                                    devices=(DeviceSlot(0, GPU0, 0, 1 * GIB, 0, 0),),
                                    processes=(me,)))

    path = tmp_path / UID1 / "c" / "region"
    path.parent.mkdir(parents=True)
    path.write_bytes(region(started - 7))  # the earlier process's start time, not yet replaced
    from webhook.node import metrics
    real = metrics.read_region

    def then_the_stores_land(at: str | os.PathLike[str]) -> Region:
        got = real(at)
        with open(path, "r+b") as f:  # the same file: the registration's stores now seen
            f.write(region(started))
        return got

    monkeypatch.setattr(metrics, "read_region", then_the_stores_land)
    _, reg = make(tmp_path)
    assert used_of(reg, uuid=GPU0) == 1 * GIB
    # a slot whose process is gone reads the same again: not counted
    path.write_bytes(region(started - 7))
    monkeypatch.setattr(metrics, "read_region", real)
    assert used_of(reg, uuid=GPU0) == 0


def test_a_slot_live_before_its_pid_is_seen_is_no_corrupt_region(tmp_path: Path) -> None:
    # The same relaxed stores, read in the other order: the slot's state live, its pid still
    # the 0 it had free. The library's own sweep passes such a slot by; the agent took the
    # whole region for corrupt (counted, logged, the container's figures gone that scrape).
    region = Region(pod_uid=UID1, pod_name="p", namespace="ns", container="c",
                    devices=(DeviceSlot(0, GPU0, 0, 3 * GIB, 0, 0),),
                    processes=(ProcessUsage(pid=100, used_bytes=(3 * GIB,)),
                               ProcessUsage(pid=0, used_bytes=(0,))))
    path = tmp_path / UID1 / "c" / "region"
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_region(region))
    assert [p.pid for p in read_region(path).processes] == [100]
    _, reg = make(tmp_path)
    assert used_of(reg, uuid=GPU0) == 3 * GIB
    assert samples(reg)[("gpuslice_region_errors_total", ())] == 0
