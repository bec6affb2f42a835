"""Node-agent test set-up.

Until ``webhook/node/region.py`` (the Python mirror of the interposer's region layout, written
by another part of the project) exists, a stand-in with the same API is installed so the
agent's tests can run; the stand-in is never used once the real module imports.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from dataclasses import asdict, dataclass


def _standin() -> types.ModuleType:
    mod = types.ModuleType("webhook.node.region")

    class RegionError(ValueError):
        pass

    @dataclass(frozen=True)
    class DeviceSlot:
        index: int
        uuid: str
        limit_bytes: int
        used_bytes: int
        sm_limit: int
        busy_ns: int

    @dataclass(frozen=True)
    class ProcessUsage:
        pid: int
        used_bytes: tuple

    @dataclass(frozen=True)
    class Region:
        pod_uid: str
        pod_name: str
        namespace: str
        container: str
        devices: tuple
        processes: tuple

    def encode_region(region: Region) -> bytes:
        return b"GPUSLICE-STANDIN" + json.dumps(asdict(region)).encode()

    def read_region(path: object) -> Region:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            data = f.read()
        if not data.startswith(b"GPUSLICE-STANDIN"):
            raise RegionError("bad magic")
        try:
            raw = json.loads(data[16:])
        except ValueError as exc:
            raise RegionError("truncated") from exc
        return Region(raw["pod_uid"], raw["pod_name"], raw["namespace"], raw["container"],
                      tuple(DeviceSlot(**d) for d in raw["devices"]),
                      tuple(ProcessUsage(p["pid"], tuple(p["used_bytes"]))
                            for p in raw["processes"]))

    for obj in (RegionError, DeviceSlot, ProcessUsage, Region, encode_region, read_region):
        setattr(mod, obj.__name__, obj)
    return mod


try:
    importlib.import_module("webhook.node.region")
except ImportError:
    sys.modules["webhook.node.region"] = _standin()
