"""Settings: defaults, YAML + overrides, and a bad value names its field."""

from __future__ import annotations

import hashlib

import pytest

from webhook.cli import build_parser, main, settings_from_args
from webhook.names import devices_annotation, limits_annotation
from webhook.settings import Settings, SettingsError, load_settings, settings_from_mapping


def test_defaults_are_hami_compatible() -> None:
    s = Settings()
    assert s.resource_names == ("nvidia.com/gpu", "nvidia.com/gpumem",
                                "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")
    assert s.node_selector == {"gpu": "on"}
    assert s.scheduler_name == "gpuslice-scheduler"
    assert s.split_count == 10 and s.port == 8443


def test_yaml_file_then_overrides_win(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("split-count: 4\nscheduler_name: sched\ntolerations:\n"
                   "  - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}\n")
    s = load_settings(cfg, {"split_count": 6, "runtime_class_name": None})
    assert s.split_count == 6 and s.scheduler_name == "sched"
    assert s.tolerations == ({"key": "nvidia.com/gpu", "operator": "Exists",
                              "effect": "NoSchedule"},)


@pytest.mark.parametrize("data, field", [
    ({"split_count": 0}, "split_count"),
    ({"split_count": "ten"}, "split_count"),
    ({"namespace_mode": "sometimes"}, "namespace_mode"),
    ({"resource_gpu": "not a name!"}, "resource_gpu"),
    ({"resource_mem": "nvidia.com/gpu"}, "resource_*"),
    ({"resource_priority": "nvidia.com/gpucores"}, "resource_priority"),
    ({"resource_priority": "priority!"}, "resource_priority"),
    ({"port": 70000}, "port"),
    ({"tolerations": [{"key": "a", "operator": "Maybe"}]}, "tolerations"),
    ({"tolerations": "x"}, "tolerations"),
    # Tolerations the API server refuses in every GPU pod (ValidateTolerations).
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "true"}]},
     "tolerations"),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule",
                       "tolerationSeconds": 300}]}, "tolerations"),
    ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "tolerations"),
    ({"tolerations": [{"key": "not a key!", "operator": "Exists"}]}, "tolerations"),
    ({"tolerations": [{"key": "gpu", "value": "not a value!"}]}, "tolerations"),
    ({"tolerations": [{"key": "gpu", "value": 1}]}, "tolerations"),
    ({"tolerations": [{"key": "gpu", "effect": "NoExecute", "tolerationSeconds": "300"}]},
     "tolerations"),
    ({"default_policy": "random"}, "default_policy"),
    ({"node_label_value": "not valid!"}, "node_label_value"),
    ({"no_such_setting": 1}, "no_such_setting"),
    # Values of the wrong type (YAML "log_level: 10", an empty "cert_dir:"), which raised
    # AttributeError or TypeError at start-up instead.
    ({"log_level": 10}, "log_level"),
    ({"log_level": None}, "log_level"),
    ({"cert_dir": None}, "cert_dir"),
    ({"cert_dir": 5}, "cert_dir"),
    ({"kubeconfig": 5}, "kubeconfig"),
    # YAML true is a bool, which Python counts as the int 1: every GPU pod was denied as
    # asking for more than "the largest GPU in the cluster has True MiB".
    ({"max_gpu_memory_mib": True}, "max_gpu_memory_mib"),
])
def test_bad_setting_is_rejected_naming_the_field(data: dict, field: str) -> None:
    with pytest.raises(SettingsError) as err:
        settings_from_mapping(data)
    assert field in str(err.value)


def test_set_null_clears_a_setting_of_the_config_file(tmp_path) -> None:
    """--set KEY=VALUE reads VALUE as YAML: null is the "none" of runtime_class_name,
    scheduler_lease and the like, and was passed over (the file's value stayed)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("runtime_class_name: nvidia\nscheduler_lease: gpuslice-system/sched\n"
                   "split_count: 4\n")
    args = build_parser().parse_args([
        "serve", "--config", str(cfg), "--port", "9443", "--set", "runtime_class_name=null",
        "--set", "scheduler_lease=~", "--set", "split_count=6"])
    s = settings_from_args(args)
    assert s.runtime_class_name is None and s.scheduler_lease is None
    assert s.split_count == 6 and s.port == 9443


def test_bad_config_file_stops_cli_with_field_name(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("split_count: -1\n")
    assert main(["check", "--config", str(cfg), "-f", str(cfg)]) == 2
    assert "split_count" in capsys.readouterr().err


@pytest.mark.parametrize("line, field", [("log_level: 10", "log_level"),
                                         ("log_level:", "log_level"),
                                         ("cert_dir:", "cert_dir")])
def test_a_value_of_the_wrong_type_stops_the_cli_naming_the_field_not_a_traceback(
        tmp_path, capsys, line: str, field: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(line + "\n")
    assert main(["check", "--config", str(cfg), "-f", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuslice: configuration error: ") and f"'{field}'" in err


def test_unreadable_or_invalid_yaml_is_a_settings_error(tmp_path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(bad)


def test_devices_annotation_key_is_shortened_past_63_characters() -> None:
    assert devices_annotation("main") == "gpuslice.io/devices.main"
    long = "c" * 60
    key = devices_annotation(long)
    name_part = key.split("/", 1)[1]
    assert len(name_part) <= 63
    assert name_part.startswith("devices." + "c" * 46 + "-")
    assert devices_annotation("c" * 55) == "gpuslice.io/devices." + "c" * 55
    assert devices_annotation(long) != devices_annotation(long + "x")


def test_limits_annotation_key_is_shortened_past_63_characters_like_the_devices_key() -> None:
    assert limits_annotation("main") == "gpuslice.io/limits.main"
    assert limits_annotation("main") != devices_annotation("main")
    # "limits." is one character shorter than "devices.": 56 characters still fit.
    assert limits_annotation("c" * 56) == "gpuslice.io/limits." + "c" * 56
    assert devices_annotation("c" * 56) != "gpuslice.io/devices." + "c" * 56
    for long in ("c" * 57, "c" * 63, "0-very-long-container-name-that-hits-the-dns-label-limit-abcdef"):
        key = limits_annotation(long)
        name_part = key.split("/", 1)[1]
        assert len(name_part) <= 63
        digest = hashlib.sha256(long.encode()).hexdigest()[:8]
        assert name_part == f"limits.{long[:46]}-{digest}"
        # The same shortened name as the devices key, under its own prefix.
        assert devices_annotation(long) == f"gpuslice.io/devices.{long[:46]}-{digest}"
        assert key != devices_annotation(long)
    assert limits_annotation("c" * 60) != limits_annotation("c" * 61)
