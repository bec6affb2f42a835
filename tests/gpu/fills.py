"""Fill-to-OOM runs of PyTorch, CuPy and JAX under a 10 GiB cap, and their context footprints.

A fill run preloads the library with ``CUDA_DEVICE_MEMORY_LIMIT=10g`` and allocates chunks
(largest first, small ones last) until the framework raises its out-of-memory error, while
the parent watches the child's real usage through NVML. Several checks read the same run,
so each variant runs once per session (:class:`Fills`).
"""

from __future__ import annotations

from typing import Any

from gpu import harness
from gpu.harness import CAP_MIB, MIB, ChildError, record
from gpu.nvmlwatch import Nvml, Poller

# What a fill may fall short of the cap by, beyond the context's own footprint.
SLACK_MIB = 64

JAX_BASE = {"JAX_PLATFORMS": "cuda", "TF_CPP_MIN_LOG_LEVEL": "2"}
# What makes JAX use the whole slice: no up-front pool (default 75% of the reported total)
# and one driver allocation per buffer, so the cap is the only limit.
JAX_PLATFORM = {**JAX_BASE, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}

# variant: (framework, chunk sizes in MiB largest first, extra env, child timeout in s).
# PyTorch serves requests of 1-10 MiB from 20 MiB segments (up to 1 MiB from 2 MiB ones),
# hence 12 (a segment of its own) then 1 MiB at the end.
VARIANTS: dict[str, tuple[str, str, dict[str, str], float]] = {
    "torch": ("torch", "256,64,12,1", {}, 60),
    # expandable segments: cuMemCreate + cuMemMap per 20 MiB page (the VMM hooks)
    "torch-expandable": ("torch", "256,64,12,1",
                         {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, 60),
    "cupy": ("cupy", "256,64,16,4,1", {}, 45),
    "jax": ("jax", "256,64,16,4,1", JAX_PLATFORM, 75),
    # one chunk size: JAX's default (BFC) pool waits 10 s before it reports each failed
    # allocation, so every size tried after the first out-of-memory cost 10 s more
    "jax-default": ("jax", "256", JAX_BASE, 75),
}

# Every capped run watched from outside: the evidence of the outside-usage check.
OUTSIDE: list[dict[str, Any]] = []


def watched(poll: Poller) -> dict[str, Any]:
    """Keep a capped run's outside maximum for the outside-usage check."""
    summary = poll.summary()
    OUTSIDE.append(summary)
    return summary


class Fills:
    """Runs each variant's capped fill and footprint probe at most once per session."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._fills: dict[str, dict[str, Any] | ChildError] = {}
        self._probes: dict[str, dict[str, Any] | ChildError] = {}

    def fill(self, variant: str) -> dict[str, Any]:
        """The capped fill's RESULT plus ``outside`` (the NVML watch of the child)."""
        return _once(self._fills, variant, lambda: self._run_fill(variant))

    def footprint(self, variant: str) -> dict[str, Any]:
        """The context footprint without the library: NVML usage less the framework's pool."""
        return _once(self._probes, variant, lambda: self._run_probe(variant))

    def check_largest(self, variant: str) -> dict[str, Any]:
        """Fill `variant` to OOM; record and check the largest total against the context footprint
        (one context probe per framework: the allocator's settings do not change the context)."""
        context = self.footprint(variant.split("-")[0])
        fill = self.fill(variant)
        largest = fill["peak"]["allocated"] / MIB
        footprint = CAP_MIB - largest
        allowed = context["footprint_mib"] + SLACK_MIB
        ok = (bool(fill["ooms"]) and not fill["guard_hit"] and largest <= CAP_MIB
              and footprint <= allowed)
        record(f"largest_{variant.replace('-', '_')}",
               f"{largest:,.0f} MiB ({largest / 1024:.2f} GiB); footprint {footprint:,.0f} "
               f"(context {context['footprint_mib']:,.0f})",
               ok, largest_mib=largest, footprint_mib=footprint, context=context,
               reserved_mib=fill["peak"]["reserved"] / MIB, ooms=fill["ooms"],
               outside=fill["outside"], view=fill["peak"]["view"], nvml_inside=fill["peak"]["nvml"],
               init_s=fill["init_s"])
        assert not fill["guard_hit"], f"{largest:,.0f} MiB allocated without an OOM: no cap"
        assert fill["ooms"], "the fill ended without an out-of-memory error"
        assert largest <= CAP_MIB, f"{largest:,.0f} MiB allocated under a {CAP_MIB} MiB cap"
        assert footprint <= allowed, (
            f"cap - largest = {footprint:,.0f} MiB > context {context['footprint_mib']:,.0f}"
            f" + {SLACK_MIB} MiB")
        return fill

    def _run_fill(self, variant: str) -> dict[str, Any]:
        framework, chunks, extra, timeout = VARIANTS[variant]
        env = harness.capped_env(harness.new_region(f"fill-{variant}"), extra=extra)
        with Poller(self.nvml, f"fill-{variant}") as poll:
            result = harness.run(harness.workload("fill", framework, chunks), env, timeout, poll)
        result["outside"] = watched(poll)
        return result

    def _run_probe(self, variant: str) -> dict[str, Any]:
        framework, _, extra, timeout = VARIANTS[variant]
        with Poller(self.nvml, f"probe-{variant}") as poll:
            result = harness.run(harness.workload("probe", framework),
                                 harness.plain_env(extra), timeout, poll)
        return {"footprint_mib": round((poll.max_bytes - result["reserved"]) / MIB, 1),
                "nvml_mib": round(poll.max_mib, 1), "pool_mib": round(result["reserved"] / MIB, 1),
                "method": poll.method, "init_s": result["init_s"]}


def _once(cache: dict[str, Any], key: str, make: Any) -> dict[str, Any]:
    if key not in cache:
        try:
            cache[key] = make()
        except ChildError as exc:
            cache[key] = exc
    value = cache[key]
    if isinstance(value, ChildError):
        raise ChildError(str(value))
    return value
