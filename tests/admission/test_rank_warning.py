"""The warning for one rank of a job spread over pods under a compute limit below 50 %.

Ranks in different pods are paced apart by the interposer (each pod has its own region and
clocks), and under a limit below 50 % collectives that spin while a peer waits for its budget
stall (``interposer/README.md``, "Ranks across devices"); within one pod they wait together.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from webhook.admission.mutate import mutate_pod
from webhook.settings import settings_from_mapping

SETTINGS = settings_from_mapping({})


def rank_pod(gpus: str, cores: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": gpus, "nvidia.com/gpucores": cores}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "namespace": "ml"},
            "spec": {"containers": [{"name": "worker", "image": "train:1", "env": env,
                                     "resources": {"limits": limits}}]}}


def warned(pod: dict[str, Any]) -> list[str]:
    result = mutate_pod(pod, SETTINGS)
    assert result.allowed
    return [w for w in result.warnings if "one rank of a job spread over pods" in w]


@pytest.mark.parametrize(("gpus", "cores", "env"), [
    ("1", "30", [{"name": "WORLD_SIZE", "value": "2"}]),
    ("2", "49", [{"name": "WORLD_SIZE", "value": " 8 "}]),
    ("4", "10", [{"name": "PET_NNODES", "value": "2"}]),
    # Kubeflow's elastic PyTorchJob: min:max nodes (its training-operator writes "1:4")
    ("1", "20", [{"name": "PET_NNODES", "value": "1:4"}]),
    ("2", "30", [{"name": "PET_NNODES", "value": "2:2"}]),
    # LeaderWorkerSet's webhook: the pods of the group (leader and workers)
    ("1", "30", [{"name": "LWS_GROUP_SIZE", "value": "2"}]),
    ("1", "30", [{"name": "WORLD_SIZE", "value": "9" * 9}]),  # the longest count read
], ids=["two-pods", "more-ranks-than-gpus", "kubeflow-nodes", "elastic-up-to-4-nodes",
        "elastic-2-nodes", "lws-group-of-2", "nine-digits"])
def test_a_rank_of_a_job_over_pods_is_warned(gpus, cores, env):
    (warning,) = warned(rank_pod(gpus, cores, env))
    assert f"gpucores {cores}" in warning and "one pod with all its GPUs" in warning


@pytest.mark.parametrize(("gpus", "cores", "env"), [
    ("2", "30", [{"name": "WORLD_SIZE", "value": "2"}]),       # every rank in this pod
    ("1", "50", [{"name": "WORLD_SIZE", "value": "4"}]),       # no stall at 50 % or more
    ("1", "100", [{"name": "WORLD_SIZE", "value": "4"}]),      # not limited
    ("1", "30", [{"name": "PET_NNODES", "value": "1"}]),       # one node
    ("1", "30", [{"name": "PET_NNODES", "value": "1:1"}]),     # elastic, one node
    ("1", "30", [{"name": "PET_NNODES", "value": "1:2:3"}]),   # not torchrun's format
    ("1", "30", [{"name": "WORLD_SIZE", "value": "1:4"}]),     # a range is nodes only
    ("4", "30", [{"name": "LWS_GROUP_SIZE", "value": "1"}]),   # a group of one pod
    ("1", "30", [{"name": "LWS_GROUP_SIZE", "value": "1:4"}]),  # LWS writes no range
    ("1", "30", [{"name": "WORLD_SIZE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
    ("1", "30", [{"name": "WORLD_SIZE", "value": "$(N)"}]),    # not a number we can read
    ("1", "30", [{"name": "WORLD_SIZE", "value": "\u00b2"}]),  # a digit to isdigit(), not to int()
    ("1", "30", [{"name": "WORLD_SIZE", "value": "7" * 5000}]),  # past int()'s 4,300 digits
    ("1", "30", [{"name": "WORLD_SIZE", "value": "1" + "0" * 9}]),  # ten digits: not read
    ("1", "30", []),
], ids=["ranks-in-one-pod", "cores-50", "cores-100", "one-node", "elastic-one-node",
        "three-parts", "world-size-range", "lws-group-of-1", "lws-range", "value-from", "not-a-number",
        "superscript-digit", "thousands-of-digits", "ten-digits", "no-env"])
def test_no_warning_where_the_ranks_can_wait_together_or_need_not(gpus, cores, env):
    assert warned(rank_pod(gpus, cores, env)) == []


def test_the_warning_comes_once():
    first = mutate_pod(rank_pod("1", "30", [{"name": "WORLD_SIZE", "value": "2"}]), SETTINGS)
    assert len(first.warnings) == 1
    again = mutate_pod(first.pod, SETTINGS)
    assert again.warnings == ()


def test_a_rank_variable_a_later_webhook_puts_first_is_warned_on_the_next_pass():
    """The API server calls the webhook again after a later one changed the pod; the pass that
    first sees LeaderWorkerSet's LWS_GROUP_SIZE (put ahead of gpuslice's env) warns, once."""
    first = mutate_pod(rank_pod("1", "30", [{"name": "HOME", "value": "/root"}]), SETTINGS)
    assert first.warnings == ()
    assert first.pod is not None
    later = copy.deepcopy(first.pod)
    later["spec"]["containers"][0]["env"][:0] = [{"name": "LWS_GROUP_SIZE", "value": "4"}]
    again = mutate_pod(later, SETTINGS)
    assert [w for w in again.warnings if "LWS_GROUP_SIZE=4 looks like one rank" in w] == \
        list(again.warnings) != []
    assert again.pod is not None and mutate_pod(again.pod, SETTINGS).warnings == ()
