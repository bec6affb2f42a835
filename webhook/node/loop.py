"""The node agent's main loop: metrics server, then discover/install/publish/clean up rounds.

Start the metrics server, then loop. Each round, and again every ``--interval``:

1. discover the GPUs (a node without driver or GPUs is logged once and publishes zeros); a
   discovery hung in an NVML call (a GPU fallen off the bus) is waited on for at most
   ``inventory.HUNG_S``, then the round goes on with the GPU it queries Unhealthy
   (:meth:`Agent._discover`), so the rounds, and /healthz with them, go on; a first discovery
   that is slow, not hung, is not published before it ends (the round retries soon);
2. install the library and ld.so.preload (idempotent); make the state dirs writable by every
   container user (``cleanup.share_state_dirs``);
3. publish the annotation, labels and extended resources, but only once the library is in
   place, so no GPU pod is scheduled onto a node that cannot isolate it;
4. list the node's pods, then remove the old library versions nothing uses (no GPU container
   that started before the last change of ld.so.preload running: /proc does not show a
   sandbox's processes) and the state dirs of pods the API server no longer has on the node.
   Without an API server (``--no-kube``) the old libraries go after step 2, by /proc alone.

Beside the rounds, every ``--audit-interval``: the outside check (:mod:`webhook.node.audit`),
each container's GPU memory as NVML sees it against its cap, and its share of each GPU's time
over ``--compute-window`` against its compute limit (sampled every second,
:mod:`webhook.node.compute`).

An API or install failure shortens the wait to an exponential backoff with jitter (1 s
doubling, capped at the interval) instead of ending the process, though never below the
``Retry-After`` of a request the API server refused with 429 (it sheds load; every node's agent
asks it); metrics keep being served throughout. SIGTERM/SIGINT stop the loop and the process exits 0, within
:data:`SHUTDOWN_BOUND_S` (under the pod's grace period): the round in progress is cancelled
(one waiting on an API server that does not answer would otherwise run on for its requests'
30 s timeouts), scrapes in flight get :data:`METRICS_SHUTDOWN_S`, NVML's shutdown waits at
most :data:`NVML_CLOSE_S` for a call in flight and is skipped if it is hung, and the exit waits
at most :data:`EXIT_WAIT_S` for the worker threads (:func:`serve`).

A round cancelled at any of its awaits leaves nothing half done: a call running in a worker
thread (discovery, install, opening the state dirs, removing a departed pod's) is not stopped
by the cancellation and runs to its end (the install's writes are atomic renames); the API
requests are a read, two merge patches each applied whole or not at all, and pod lists. One
cancelled between the node's metadata patch and its status patch leaves the node as a
rejected status patch does (resources not yet updated), which the next agent's first round
puts right.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

from aiohttp import web
from kubernetes_asyncio import client, config

from webhook import names
from webhook.node import cleanup, install
from webhook.node import inventory as nvml_inventory
from webhook.node.audit import MIB, Auditor
from webhook.node.compute import SAMPLE_INTERVAL
from webhook.node.config import AgentSettings
from webhook.node.inventory import Discovery, Inventory
from webhook.node.metrics import AgentCollector, AgentStatus, make_registry, metrics_app
from webhook.node.publish import API_ERRORS, Publisher, api_error

logger = logging.getLogger(__name__)

STALL_MIN_S = 300.0
"""The least time without an ended round after which /healthz fails (see ``Agent.stalled``)."""
METRICS_SHUTDOWN_S = 2.0
"""At shutdown, how long a scrape in flight may take before it is cancelled (aiohttp waits
twice this at most: for the handler, then for its cancellation). One waiting on a hung NVML
call would otherwise hold the shutdown up for aiohttp's default 60 s."""
NVML_CLOSE_S = 2.0
"""At shutdown, how long NVML's shutdown waits for a call in flight; one still running then is
hung (a GPU fallen off the bus) and NVML is left as it is: the process is exiting."""
EXIT_WAIT_S = 3.0
"""At exit, how long the process waits for its worker threads (a hung NVML call's never ends;
Python would wait for it forever)."""
SHUTDOWN_BOUND_S = 2 * METRICS_SHUTDOWN_S + NVML_CLOSE_S + 0.5 + EXIT_WAIT_S
"""The most a SIGTERM'd agent takes to exit, less than the pod's grace period (the chart sets
none: Kubernetes' 30 s; tests/chart/test_chart_wiring.py checks it)."""

def oldest_gpu_container(pods: Iterable[client.V1Pod]) -> float:
    """When the oldest running container of a pod the webhook mutated started (Unix time; one
    without a start time counts as the oldest), ``math.inf`` for none: each such container
    bind-mounts the host's ld.so.preload as it was then."""
    oldest = math.inf
    for pod in pods:
        meta, status = pod.metadata, pod.status
        if not meta or not status or names.ANN_MUTATED not in (meta.annotations or {}):
            continue
        for st in [*(status.container_statuses or []), *(status.init_container_statuses or [])]:
            running = st.state.running if st.state else None
            if running is not None:
                started = running.started_at
                if started is not None and started.tzinfo is None:
                    started = started.replace(tzinfo=UTC)  # (the API server's times are UTC)
                oldest = min(oldest, started.timestamp() if started else -math.inf)
    return oldest


def retry_after(exc: BaseException) -> float:
    """The ``Retry-After`` (seconds) of a 429 answer; 0 for any other failure."""
    if getattr(exc, "status", None) != 429:
        return 0.0
    value = str((getattr(exc, "headers", None) or {}).get("Retry-After") or "")
    return float(value) if value.isdigit() else 0.0


class Backoff:
    """Exponential backoff with equal jitter: the n-th delay is in [d/2, d], d = base x 2^n."""

    def __init__(self, base: float = 1.0, cap: float = 60.0,
                 rng: Callable[[], float] = random.random) -> None:
        self.base, self.cap, self._rng = base, cap, rng
        self.failures = 0

    def next(self) -> float:
        d = min(self.cap, self.base * (2 ** min(self.failures, 30)))
        self.failures += 1
        return d / 2 + self._rng() * d / 2

    def reset(self) -> None:
        self.failures = 0


class Agent:
    """One node's agent. ``start`` serves metrics; ``step`` runs one round; ``run`` loops."""

    def __init__(self, settings: AgentSettings, library: bytes, *,
                 inventory: Inventory | None = None,
                 api_client: client.ApiClient | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.library = library
        self.inventory = inventory or Inventory(
            offer_exclusive_process=settings.offer_exclusive_process,
            xid_check=settings.xid_check, skip_xids=settings.skip_xids)
        # a GPU recovers over RECOVER_ROUNDS rounds at the interval, also when they back off
        self.inventory.recover_s = (nvml_inventory.RECOVER_ROUNDS - 1) * settings.interval
        self.api_client = api_client
        self.publisher = Publisher(api_client, settings) if api_client is not None else None
        self.status = AgentStatus()
        self.auditor = Auditor(
            self.inventory, settings.proc_root,
            list_pods=self.publisher.node_pods if self.publisher is not None else None,
            api_client=api_client, node_name=settings.node_name,
            tolerance_bytes=settings.over_limit_tolerance_mib * MIB,
            action=settings.over_limit_action, rounds=settings.over_limit_rounds,
            compute_window=settings.compute_window,
            compute_tolerance=settings.compute_tolerance,
            compute_action=settings.compute_over_limit_action,
            priority=settings.resource_priority,
        ) if settings.audit_interval > 0 else None
        self.collector = AgentCollector(self.inventory, settings.host_state_dir, self.status,
                                        auditor=self.auditor, proc_root=settings.proc_root)
        self.registry = make_registry(self.collector)
        self.backoff = Backoff(cap=max(settings.interval, 1.0))
        self.installed: install.InstallResult | None = None
        self.metrics_port = 0
        self._clock = clock
        self._runner: web.AppRunner | None = None
        self._round_done = time.monotonic()  # the start counts: the first round is under way
        self._in_round = False
        self._discovering: asyncio.Future[Discovery] | None = None
        self._retry_after = 0.0
        """The longest ``Retry-After`` of the round's throttled API requests (seconds)."""

    async def start(self) -> None:
        """Start serving /metrics and /healthz."""
        self._runner = web.AppRunner(metrics_app(self.registry, self.stalled), access_log=None,
                                     shutdown_timeout=METRICS_SHUTDOWN_S)
        await self._runner.setup()
        # "" (None to asyncio): one socket per address family, IPv4 and IPv6
        site = web.TCPSite(self._runner, self.settings.metrics_host or None,
                           self.settings.metrics_port)
        await site.start()
        addresses = self._runner.addresses
        self.metrics_port = int(addresses[0][1]) if addresses else self.settings.metrics_port
        logger.info("metrics served", extra={"host": self.settings.metrics_host,
                                             "port": self.metrics_port})

    async def close(self) -> None:
        """Stop serving metrics and shut NVML down, off the event loop and bounded: NVML is left
        as it is if a call to it is still running after :data:`NVML_CLOSE_S`."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        try:
            closed = await asyncio.wait_for(
                asyncio.to_thread(self.inventory.close, NVML_CLOSE_S), NVML_CLOSE_S + 0.5)
        except TimeoutError:  # nvmlShutdown itself hung
            closed = False
        if not closed:
            logger.warning("NVML not shut down: a call to it is still running (a GPU off the "
                           "bus?); exiting without it", extra={"waited_s": NVML_CLOSE_S})

    def _install(self) -> bool:
        s = self.settings
        try:
            result = install.install(self.library, s.host_library_dir, s.preload_target,
                                     s.version)
        except install.InstallError as exc:
            logger.error("library install failed; GPUs are not published until it succeeds",
                         extra={"error": str(exc)})
            self.status.install_errors += 1
            self.status.library = ""  # not known to be in place any more
            return False
        self.installed = result
        self.status.library = result.library.name
        return True

    def _clean_libraries(self, oldest_container: float | None) -> None:
        """Remove the old library versions nothing uses (``install.clean_up_libraries``)."""
        s = self.settings
        assert self.installed is not None
        done = install.clean_up_libraries(s.host_library_dir, self.installed.library,
                                          s.proc_root, oldest_container=oldest_container)
        self.status.libraries_removed += sum(1 for n in done.removed
                                             if n.startswith(install.LIB_STEM))
        self.status.old_libraries = len(done.kept)
        self.status.library_cleanup_blocked = bool(done.blocked)

    def _share_state_dirs(self) -> bool:
        try:
            changed = cleanup.share_state_dirs(self.settings.host_state_dir)
        except OSError as exc:
            logger.error("cannot prepare the state dirs; non-root containers may get a budget "
                         "per process", extra={"path": self.settings.host_state_dir,
                                               "error": str(exc)})
            return False
        if changed:
            logger.info("state dirs opened to every container user",
                        extra={"path": self.settings.host_state_dir, "dirs": changed[:20],
                               "count": len(changed)})
        return True

    async def step(self) -> float:
        """One round of discover, install, publish, clean up; return seconds until the next."""
        ok = True
        self._retry_after = 0.0
        discovery = await self._discover()
        installed = await asyncio.to_thread(self._install)
        if installed and self.publisher is None:  # no pod list: /proc alone tells
            await asyncio.to_thread(self._clean_libraries, None)
        shared = await asyncio.to_thread(self._share_state_dirs)
        ok = ok and installed and shared
        pods: list[client.V1Pod] | None = None
        if discovery is None:  # the first discovery is slow, not hung: nothing to publish yet
            ok = False
            logger.info("the first GPU discovery is still running; the node's GPUs are "
                        "published once it ends", extra={"node": self.settings.node_name})
        elif self.publisher is not None and installed:
            try:
                outcome = await self.publisher.publish(discovery)
            except API_ERRORS as exc:
                ok = False
                self._retry_after = max(self._retry_after, retry_after(exc))
                self.status.publish_errors += 1
                logger.warning("publishing the node's GPUs failed; will retry",
                               extra={"node": self.settings.node_name,
                                      "error": api_error(exc)})
            else:
                self.status.last_publish_success = self._clock()
                pods = outcome.pods
                if outcome.metadata_patched or outcome.status_patched:
                    logger.info("node GPUs published", extra={
                        "node": self.settings.node_name, "gpus": len(discovery.gpus),
                        "healthy": len(discovery.healthy),
                        "metadata": outcome.metadata_patched,
                        "resources": outcome.status_patched})
        if self.publisher is not None:
            ok = await self._cleanup(installed, pods) and ok
        if ok:
            self.backoff.reset()
            return self.settings.interval
        return min(max(self.backoff.next(), self._retry_after), self.settings.interval)

    async def _discover(self) -> Discovery | None:
        """The GPUs (``Inventory.discover`` in a worker thread), waited on for at most
        ``inventory.HUNG_S`` (and a little): a discovery still running then (slow over many GPUs,
        or hung in an NVML call) is left to run (the next rounds wait on it, and start no
        other); meanwhile the GPUs are as ``Inventory.last`` says, with the one it queries
        Unhealthy if its call has run for ``HUNG_S``. None while the first discovery runs,
        slow but not hung: ``last`` is then no discovery's (a restarted agent published it as
        NVML unavailable, withdrawing the node's GPUs until its next round)."""
        if self._discovering is None:
            self._discovering = asyncio.ensure_future(asyncio.to_thread(self.inventory.discover))
        done, _ = await asyncio.wait({self._discovering}, timeout=nvml_inventory.HUNG_S + 0.5)
        if not done:
            if not self.inventory.discovered and self.inventory.hung() is None:
                return None
            return self.inventory.last
        task, self._discovering = self._discovering, None
        return task.result()

    async def _cleanup(self, installed: bool, pods: list[client.V1Pod] | None = None) -> bool:
        """Remove old libraries (after an install that succeeded) and the state dirs of
        departed pods, both in the light of the node's pods (``pods``: as the round's publish
        listed them from the watch cache, after the install; else listed so now); False if they
        cannot be listed."""
        assert self.publisher is not None
        s, now = self.settings, self._clock()
        try:
            if pods is None:
                pods = await self.publisher.node_pods(cached=True)
        except API_ERRORS as exc:
            self._retry_after = max(self._retry_after, retry_after(exc))
            logger.warning("listing the node's pods failed; no state dir or old library removed",
                           extra={"node": self.settings.node_name, "error": api_error(exc)})
            return False
        if installed:  # (the watch cache's lag is within install.PINNED_MARGIN_S)
            await asyncio.to_thread(self._clean_libraries, oldest_gpu_container(pods))
        try:
            names = {p.metadata.uid: (p.metadata.namespace or "", p.metadata.name or "")
                     for p in pods if p.metadata and p.metadata.uid}
            self.collector.pod_names = names  # the metrics' names for the pods' state dirs
            self.collector.pod_names_at = now
            live = set(names)
            if await asyncio.to_thread(cleanup.stale_pod_dirs, s.host_state_dir, live,
                                       s.cleanup_grace, now):
                # before removing anything, a consistent read: the watch cache may lag
                live = {p.metadata.uid for p in await self.publisher.node_pods()
                        if p.metadata and p.metadata.uid}
        except API_ERRORS as exc:
            self._retry_after = max(self._retry_after, retry_after(exc))
            logger.warning("listing the node's pods failed; no state dir removed",
                           extra={"node": self.settings.node_name, "error": api_error(exc)})
            return False
        removed = await asyncio.to_thread(cleanup.remove_stale, s.host_state_dir, live,
                                          s.cleanup_grace, now)
        self.status.cleanup_removed += len(removed)
        return True

    async def audit(self) -> None:
        """One outside memory check (``webhook.node.audit``); a failure is logged, not raised."""
        if self.auditor is None:
            return
        try:
            await self.auditor.check()
        except Exception:  # a bug must not end the checks, nor the agent
            self.auditor.errors += 1
            logger.exception("outside memory check failed")
        else:
            self.status.last_audit = self._clock()

    async def _audit_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.audit()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.settings.audit_interval)
            except TimeoutError:
                pass

    async def sample_compute(self) -> None:
        """One poll of the outside compute check's sampler; a failure is logged, not raised."""
        if self.auditor is None or self.auditor.compute is None:
            return
        try:
            await asyncio.to_thread(self.auditor.compute.poll)
        except Exception:  # a bug must not end the sampling, nor the agent
            self.auditor.errors += 1
            logger.exception("sampling the GPUs' per-process utilisation failed")

    async def _sample_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample_compute()
            try:
                await asyncio.wait_for(stop.wait(), timeout=SAMPLE_INTERVAL)
            except TimeoutError:
                pass

    async def run(self, stop: asyncio.Event) -> None:
        """Round after round until ``stop`` is set; the outside checks beside them, at their
        own intervals (the compute check's sampler every second). Once ``stop`` is set, the
        round in progress is cancelled (see the module's notes), as are the checks."""
        beside = []
        if self.auditor is not None:
            beside.append(asyncio.create_task(self._audit_loop(stop)))
            if self.auditor.compute is not None:
                beside.append(asyncio.create_task(self._sample_loop(stop)))
        rounds = asyncio.create_task(self._rounds(stop))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({rounds, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not rounds.done():
                logger.info("stopping", extra={"round_cancelled": self._in_round})
        finally:
            # a round or check waiting on the API server must not hold up SIGTERM
            tasks = (stopped, rounds, *beside)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        if not rounds.cancelled():
            rounds.result()  # a bug past the rounds' own handling ends the agent, as before

    def stalled(self) -> str | None:
        """Why the agent is not healthy: no round has ended (well or not) for five intervals
        and at least five minutes, e.g. a call that never returns; None when healthy."""
        limit = max(5 * self.settings.interval, STALL_MIN_S)
        quiet = time.monotonic() - self._round_done
        return f"no agent round has ended for {quiet:.0f} s" if quiet > limit else None

    async def _rounds(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._in_round = True
            try:
                delay = await self.step()
            except Exception:  # a bug must not end the DaemonSet pod's metrics either
                logger.exception("agent round failed")
                delay = min(self.backoff.next(), self.settings.interval)
            self._in_round = False
            self._round_done = time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass


async def _api_client(settings: AgentSettings) -> client.ApiClient:
    conf = client.Configuration()
    if settings.kubeconfig:
        await config.load_kube_config(config_file=settings.kubeconfig, client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    return client.ApiClient(conf)


async def main(settings: AgentSettings, library: bytes) -> int:
    api: client.ApiClient | None = None
    if settings.kube_enabled:
        try:
            api = await _api_client(settings)
        except (config.ConfigException, OSError) as exc:
            logger.error("no Kubernetes API configuration; pass --kubeconfig, run in-cluster, "
                         "or use --no-kube", extra={"error": str(exc)})
            return 2
    agent = Agent(settings, library, api_client=api)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
        logger.info("agent started", extra={"node": settings.node_name,
                                            "kube": settings.kube_enabled,
                                            "interval": settings.interval})
        await agent.run(stop)
    finally:
        await agent.close()
        if api is not None:
            await api.close()
    logger.info("agent stopped")
    return 0


def serve(settings: AgentSettings, library: bytes) -> int:
    """``asyncio.run(main(settings, library))``, except that the exit waits at most
    :data:`EXIT_WAIT_S` for the worker threads; one still busy then (an NVML call hung on a GPU
    fallen off the bus) is left behind: the logs are flushed and the process ends at once
    (``os._exit``), since both ``asyncio.run`` and the interpreter's exit would wait for it
    forever, until the kubelet's SIGKILL."""
    executor = ThreadPoolExecutor(thread_name_prefix="agent")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # as asyncio.run: the client libraries look it up
    loop.set_default_executor(executor)
    rc, failure = 1, None
    try:
        rc = loop.run_until_complete(main(settings, library))
    except Exception as exc:
        failure = exc
        raise
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        executor.shutdown(wait=False, cancel_futures=True)  # idle workers end now
        asyncio.set_event_loop(None)
        loop.close()
        if not _threads_end(EXIT_WAIT_S):
            logger.warning("a worker thread is still busy (an NVML call hung?); exiting "
                           "without it", extra={"waited_s": EXIT_WAIT_S})
            if failure is not None:  # os._exit: no traceback printed otherwise
                logger.error("agent failed", exc_info=failure)
            logging.shutdown()
            os._exit(rc)
    return rc


def _threads_end(timeout: float) -> bool:
    """Whether every other non-daemon thread ends within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
    return True

