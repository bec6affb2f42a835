"""The agent's flags (the chart passes exactly these) and their validation."""

from __future__ import annotations

import argparse

import pytest

from webhook.cli import build_parser
from webhook.node.config import AgentSettings, add_arguments, settings_from_args
from webhook.settings import SettingsError

CHART_ARGS = [
    "agent", "--node-name", "gpu-node-1",
    "--library-source", "/opt/gpuslice/libgpuslice.so",
    "--host-library-dir", "/usr/local/gpuslice",
    "--preload-target", "/usr/local/gpuslice",
    "--host-state-dir", "/var/lib/gpuslice/containers",
    "--proc-root", "/host/proc",
    "--metrics-port", "9400", "--metrics-host", "0.0.0.0",
    "--interval", "60", "--split-count", "10",
    "--resource-gpu", "nvidia.com/gpu", "--resource-mem", "nvidia.com/gpumem",
    "--resource-cores", "nvidia.com/gpucores", "--resource-priority", "nvidia.com/priority",
    "--log-level", "INFO", "--log-format", "json",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_cli_agent_subcommand_accepts_every_chart_flag() -> None:
    args = build_parser().parse_args(CHART_ARGS)
    s = settings_from_args(args)
    assert s.node_name == "gpu-node-1"
    assert s.proc_root == "/host/proc"
    assert s.log_format == "json"
    assert s.kube_enabled is True
    assert args.func.__name__ == "call"


def test_defaults_are_the_documented_paths_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "n1")
    s = settings_from_args(_parse([]))
    assert s == AgentSettings(node_name="n1")
    assert (s.library_source, s.host_library_dir, s.preload_target, s.host_state_dir) == (
        "/opt/gpuslice/libgpuslice.so", "/usr/local/gpuslice", "/usr/local/gpuslice",
        "/var/lib/gpuslice/containers")
    assert (s.metrics_host, s.metrics_port, s.interval, s.split_count) == ("", 9400,
                                                                          60.0, 10)
    assert (s.resource_gpu, s.resource_mem, s.resource_cores, s.resource_priority) == (
        "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/priority")
    assert s.proc_root == "/proc" and s.kubeconfig is None
    assert (s.audit_interval, s.over_limit_tolerance_mib, s.over_limit_action,
            s.over_limit_rounds) == (10.0, 0, "none", 3)


def test_exclusive_process_gpus_are_offered_only_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "n1")
    assert settings_from_args(_parse([])).offer_exclusive_process is False
    asked = settings_from_args(_parse(["--offer-exclusive-process-gpus"]))
    assert asked.offer_exclusive_process is True
    from webhook.node.loop import Agent
    agent = Agent(asked, b"")  # the agent's own inventory takes the setting
    assert agent.inventory._offer_exclusive_process is True


def test_xid_errors_are_checked_unless_turned_off_and_more_may_be_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "n1")
    s = settings_from_args(_parse([]))
    assert (s.xid_check, s.skip_xids) == (True, ())
    s = settings_from_args(_parse(["--no-xid-check", "--skip-xids", "63, 74,"]))
    assert (s.xid_check, s.skip_xids) == (False, (63, 74))
    with pytest.raises(SystemExit):
        _parse(["--skip-xids", "63;74"])
    with pytest.raises(SettingsError, match="--skip-xids"):
        AgentSettings(node_name="n1", skip_xids=(0,))


def test_node_name_flag_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "from-env")
    assert settings_from_args(_parse(["--node-name", "from-flag"])).node_name == "from-flag"


def test_missing_node_name_is_an_error_unless_no_kube(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SettingsError, match="--node-name"):
        settings_from_args(_parse([]))
    assert settings_from_args(_parse(["--no-kube"])).kube_enabled is False


@pytest.mark.parametrize(("argv", "flag"), [
    (["--library-source", "relative.so"], "--library-source"),
    (["--proc-root", "proc"], "--proc-root"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--interval", "0"], "--interval"),
    (["--split-count", "0"], "--split-count"),
    (["--resource-gpu", "gpu"], "--resource-gpu"),
    (["--resource-mem", "nvidia.com/gpu"], "--resource-"),
    (["--resource-priority", "priority"], "--resource-priority"),
    (["--resource-priority", "nvidia.com/gpumem"], "--resource-priority"),
    (["--log-level", "LOUD"], "--log-level"),
    (["--node-name", "Not_A_Node"], "--node-name"),
    (["--cleanup-grace", "-1"], "--cleanup-grace"),
    # argparse's float() takes "nan": every unlisted pod's dir was then stale at once, a pod
    # just started by the kubelet included (its region, so its shared cap, removed)
    (["--cleanup-grace", "nan"], "--cleanup-grace"),
    (["--audit-interval", "-1"], "--audit-interval"),
    (["--over-limit-tolerance-mib", "-5"], "--over-limit-tolerance-mib"),
    (["--over-limit-rounds", "0"], "--over-limit-rounds"),
])
def test_bad_values_are_rejected_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(SettingsError, match=flag):
        settings_from_args(_parse(["--node-name", "n1", *argv]))


def test_the_task_priority_resource_is_passed_to_the_outside_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--resource-priority names HAMi's task priority (the webhook's resource_priority): the
    outside check must know it gives no device."""
    monkeypatch.setenv("NODE_NAME", "n1")
    s = settings_from_args(_parse(["--resource-priority", "example.com/vgpu-priority"]))
    assert s.resource_priority == "example.com/vgpu-priority"
    from webhook.node.loop import Agent
    agent = Agent(s, b"")
    assert agent.auditor is not None
    assert agent.auditor._priority == "example.com/vgpu-priority"


def test_an_unknown_over_limit_action_is_refused() -> None:
    with pytest.raises(SettingsError, match="--over-limit-action"):
        AgentSettings(node_name="n1", over_limit_action="kill")
    with pytest.raises(SystemExit):
        _parse(["--over-limit-action", "kill"])


def test_cli_reports_bad_agent_flags_as_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from webhook.cli import main
    assert main(["agent", "--node-name", "n1", "--split-count", "0"]) == 2
    assert "--split-count" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["/opt/gpu slice", "/opt/gpu\tslice", "/opt/gpu:slice",
                                    "/opt/#gpuslice"])
def test_a_preload_target_that_ld_so_would_split_is_refused(target: str) -> None:
    """ld.so reads /etc/ld.so.preload as names separated by white space or ':', with '#'
    starting a comment: such a target would preload nothing, and no container be capped."""
    with pytest.raises(SettingsError, match="--preload-target"):
        settings_from_args(_parse(["--node-name", "n1", "--preload-target", target]))
