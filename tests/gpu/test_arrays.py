"""Real GPU, CUDA arrays: what the library charges for an array (interposer/src/arrays.c) against
what the driver takes for it, for a 4-channel float array and for the formats whose size the
library computes from its own reading of their layout: block-compressed BC1 and BC7 (4 x 4 texel
blocks of 8 and 16 bytes, Width and Height counting texels, which no CUDA document says) and
NV12 (two planes, 1.5 bytes a pixel). Two gpubench runs of a second each: without the library
(cuMemGetInfo's used memory is the driver's own, the device's) and with it (the view's used
memory is the charge)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import MIB, record

pytestmark = pytest.mark.gpu

NOISE_MIB = 2
"""The driver maps device memory in 2 MiB pages: below that, a difference is page rounding."""


def _judge(real: int, charged: int) -> bool:
    """Never under-charged beyond page noise, never more than twice over."""
    noise = NOISE_MIB * MIB
    return real - noise <= charged <= 2 * real + noise


def test_arrays_are_charged_what_the_driver_takes(gpubench: Path, lib: Path) -> None:
    """Each format the driver accepts: charged >= real - 2 MiB and <= 2 x real + 2 MiB; a format
    it refuses is reported, and must be refused with the library too (nothing to charge)."""
    plain = harness.run([str(gpubench), "arrays"], harness.plain_env(), 30)
    capped = harness.run([str(gpubench), "arrays"],
                         harness.capped_env(harness.new_region("arrays")), 30)
    formats: list[dict[str, Any]] = []
    failed: list[str] = []
    shown: list[str] = []
    for real, lib_run in zip(plain["arrays"], capped["arrays"], strict=True):
        name = real["name"]
        entry: dict[str, Any] = {"name": name, "width": real["width"], "height": real["height"],
                                 "rc": real["rc"], "rc_with_library": lib_run["rc"]}
        formats.append(entry)
        if real["rc"] != 0:
            shown.append(f"{name} refused ({real['error']})")
            if lib_run["rc"] == 0:
                failed.append(f"{name}: refused without the library, made with it")
            continue
        if lib_run["rc"] != 0:
            shown.append(f"{name} refused with the library ({lib_run['error']})")
            failed.append(f"{name}: made by the driver, refused with the library")
            continue
        ratio = lib_run["grew"] / real["grew"] if real["grew"] > 0 else None
        good = _judge(real["grew"], lib_run["grew"])
        entry.update(real_bytes=real["grew"], charged_bytes=lib_run["grew"], ratio=ratio, ok=good)
        shown.append(f"{name} {lib_run['grew'] / MIB:,.1f}/{real['grew'] / MIB:,.1f}"
                     + ("" if ratio is None else f" ({ratio:.2f}x)"))
        if not good:
            failed.append(f"{name}: charged {lib_run['grew']:,} B for {real['grew']:,} B")
    measured = [f for f in formats if "ok" in f]
    if not measured:
        failed.append("the driver made none of the arrays")
    record("array_sizes", "charged/real MiB: " + ", ".join(shown)
           + (f"; wrong: {failed}" if failed else ""), not failed,
           formats=formats, plain=plain, with_lib=capped)
    assert not failed, f"array sizes: {failed} ({formats})"
