"""The real operator with a real admission service: membership, drains and rolling updates.

The world of ``test_operator_behaviour.py``, with the fake admin API replaced
(``service_cluster`` in conftest): the admission service is a ``kvgate admission-service``
process started from the operator's own Deployment, ConfigMap and admin-token Secret, on the
embedded Kafka-compatible broker; each executor pod is a ``kvgate sim-executor`` process on a
loopback address of its own, whose steps take 40 ms. The operator reaches the service through a
journaling proxy, so its admin calls and the service's answers are ordered against the API
server's journal.

The tests produce requests to the pool's request topic and read its result topic: work is on
the executors while the operator drains and replaces them, and every request must come back
completed exactly once. Timeouts and an unavailable admin API stay with the fake (a real
service cannot be made to misbehave on cue).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kopf.testing import KopfRunner
from tokenizers import Tokenizer

from kvgate.executor.gguf_file import GgufFile
from kvgate.executor.gguf_tokenizer import build_tokenizer
from kvgate.executor.packaged import INSTALL_HINT, packaged_gguf
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.operator.naming import step_endpoint
from kvgate.protocol.admin import ExecutorMembership, ExecutorState
from kvgate.protocol.records import InferenceResult, ResultStatus
from tests.admission_service.kafka_helpers import produce, read_results
from tests.admission_service.word_tokenizers import word_tokenizer
from tests.operator.admin_proxy import JournalingProxy
from tests.operator.cluster import Cluster, admin_token, deleted_at, operator_writes, pool_manifest
from tests.operator.pod_processes import ProcessKubelet

pytestmark = pytest.mark.timeout(90)
ServiceCluster = Cluster[JournalingProxy]


@pytest.fixture
def cluster(service_cluster: ServiceCluster) -> ServiceCluster:
    """The ``operator`` fixture runs the operator in this world."""
    return service_cluster


@pytest.fixture
def topics() -> dict[str, str]:
    base = f"op{uuid.uuid4().hex[:8]}"
    return {
        "requests": f"{base}.requests",
        "results": f"{base}.results",
        "aborts": f"{base}.aborts",
        "deadLetter": f"{base}.dlq",
    }


def service_pool(broker: EmbeddedBroker, topics: dict[str, str], **spec: Any) -> dict[str, Any]:
    kafka = {
        "bootstrapServers": broker.bootstrap,
        "topics": topics,
        "groupId": f"{topics['requests']}-group",
        "createTopics": True,
    }
    return pool_manifest(kafka=kafka, **spec)


async def membership(cluster: ServiceCluster) -> ExecutorMembership:
    """What the service itself says (asked directly, not through the operator's journal)."""
    assert cluster.admin.upstream is not None
    async with (
        aiohttp.ClientSession() as http,
        http.get(cluster.admin.upstream + "/v1/executors") as response,
    ):
        assert response.status == 200, await response.text()
        return ExecutorMembership.model_validate_json(await response.text())


async def put_membership(cluster: ServiceCluster, body: dict[str, Any], token: str) -> int:
    assert cluster.admin.upstream is not None
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as http,
        http.put(cluster.admin.upstream + "/v1/executors", json=body, headers=headers) as response,
    ):
        return response.status


async def poll_service(
    cluster: ServiceCluster, predicate: Any, *, within_s: float = 30.0
) -> ExecutorMembership:
    """Until ``predicate(membership)`` holds; the last membership read."""
    deadline = time.monotonic() + within_s
    while True:
        current = await membership(cluster)
        if predicate(current):
            return current
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {within_s:.0f} s: {current}")
        await asyncio.sleep(0.05)


def pod_endpoints(cluster: ServiceCluster) -> dict[str, str]:
    return {
        name: step_endpoint(pod["status"]["podIP"])
        for name, pod in cluster.pods().items()
        if pod.get("status", {}).get("podIP")
    }


def requests(prefix: str, count: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "request_id": f"{prefix}-{i}",
            "prompt": [(7 * i + j) % 400 + 1 for j in range(24)],
            "max_tokens": max_tokens,
            "sampling": {"ignore_eos": True, "seed": 1},
        }
        for i in range(count)
    ]


async def results_once(
    broker: EmbeddedBroker, topic: str, request_ids: set[str]
) -> list[InferenceResult]:
    """The results of ``request_ids``: each exactly once, completed at full length."""
    results = await read_results(broker.bootstrap, topic, len(request_ids), settle_s=1.0)
    assert sorted(r.request_id for r in results) == sorted(request_ids)  # none twice, none lost
    for result in results:
        assert result.status is ResultStatus.COMPLETED, result
    return results


async def test_membership_in_the_service_is_the_ready_executors(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    await cluster.create(service_pool(broker, topics, replicas=2))
    await cluster.wait_for(cluster.ready, within_s=60)

    # The service accepted the operator's PUT (with the token from the pool's Secret) and holds
    # a live session to each executor: state ready, cache size from the executor's handshake.
    current = await poll_service(
        cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY] * 2
    )
    assert {e.name: e.endpoint for e in current.executors} == pod_endpoints(cluster)
    assert sorted(pod_endpoints(cluster)) == ["pool-0", "pool-1"]
    assert all(e.kv_blocks_total == 128 for e in current.executors)
    assert cluster.admin.calls("PUT", "/v1/executors")
    assert not [c for c in cluster.admin.journal if c.status in (401, 403, 422)]
    assert {e["name"]: e["endpoint"] for e in cluster.status()["executors"]} == pod_endpoints(
        cluster
    )

    # Its admin token is the one in the pool's Secret: the same membership, put with that token,
    # is accepted; with another it is refused.
    body = {"executors": [{"name": e.name, "endpoint": e.endpoint} for e in current.executors]}
    secret_token = admin_token(cluster.api, "pool")
    assert secret_token
    assert await put_membership(cluster, body, secret_token) == 200
    assert await put_membership(cluster, body, secret_token + "x") == 401

    # It serves: a request produced to the pool's topic comes back completed.
    await produce(broker.bootstrap, topics["requests"], requests("hello", 2, max_tokens=4))
    await results_once(broker, topics["results"], {"hello-0", "hello-1"})


async def test_scale_down_drains_an_executor_that_holds_work(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    await cluster.create(service_pool(broker, topics, replicas=3))
    await cluster.wait_for(cluster.ready, within_s=60)
    await poll_service(
        cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY] * 3
    )
    # About 120 steps of 40 ms each: far longer than the operator takes to drain.
    produced = requests("drain", 12, max_tokens=120)
    await produce(broker.bootstrap, topics["requests"], produced)

    def pool_2_busy(m: ExecutorMembership) -> bool:
        return any(e.name == "pool-2" and e.running_requests > 0 for e in m.executors)

    await poll_service(cluster, pool_2_busy)
    await cluster.patch_spec("pool", {"replicas": 2})
    await cluster.wait_for(lambda: "pool-2" not in cluster.pods() and cluster.ready(), 60)

    [drain] = cluster.admin.calls("POST", "/v1/executors/pool-2/drain")
    assert drain.answer["state"] == ExecutorState.DRAINING
    assert drain.answer["running_requests"] + drain.answer["waiting_requests"] > 0
    drained = cluster.admin.first_reported("pool-2", ExecutorState.DRAINED)
    assert drained is not None, "the service never reported pool-2 drained"
    # Drain, the service's "drained", the membership without it, and only then the delete.
    assert drain.seq < drained < deleted_at(cluster, "pool-2")
    leave = [
        c.seq
        for c in cluster.admin.calls("PUT", "/v1/executors")
        if c.seq > drain.seq and [e["name"] for e in c.body["executors"]] == ["pool-0", "pool-1"]
    ]
    assert leave, "pool-2 never left the membership"
    assert drained < leave[0] < deleted_at(cluster, "pool-2")
    assert cluster.condition("Draining")["reason"] == "Drained"
    assert [name for _, name in operator_writes(cluster, "DELETE", "pods")] == ["pool-2"]
    current = await membership(cluster)
    assert sorted(e.name for e in current.executors) == ["pool-0", "pool-1"]

    results = await results_once(broker, topics["results"], {r["request_id"] for r in produced})
    moved = [r for r in results if "pool-2" in r.scheduling.executors]
    assert moved, "no request ran on pool-2"
    # What pool-2 held was lifted off it and finished on the executors that stay.
    for result in moved:
        assert result.scheduling.executors[-1] in ("pool-0", "pool-1"), result.scheduling
        assert len(result.output_token_ids) == 120


async def test_scale_to_zero_waits_for_the_work_to_finish_in_place(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    """With nowhere to move it, a drained executor's work finishes where it is: the operator
    keeps the pod until the service reports it drained, however long that takes."""
    await cluster.create(service_pool(broker, topics, replicas=1))
    await cluster.wait_for(cluster.ready, within_s=60)
    await poll_service(cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY])
    produced = requests("zero", 4, max_tokens=100)
    await produce(broker.bootstrap, topics["requests"], produced)
    await poll_service(cluster, lambda m: m.executors[0].running_requests == 4)
    await cluster.patch_spec("pool", {"replicas": 0})

    await cluster.wait_for(lambda: cluster.admin.calls("POST", "/v1/executors/pool-0/drain"))
    await cluster.wait_for(lambda: cluster.condition("Draining").get("status") == "True")
    # The operator has seen it draining, and the executor still serves its four requests.
    [status] = (await membership(cluster)).executors
    assert (status.state, status.running_requests) == (ExecutorState.DRAINING, 4)
    assert "pool-0" in cluster.pods()

    await cluster.wait_for(lambda: "pool-0" not in cluster.pods(), within_s=60)
    [drain] = cluster.admin.calls("POST", "/v1/executors/pool-0/drain")
    drained = cluster.admin.first_reported("pool-0", ExecutorState.DRAINED)
    assert drained is not None, "the service never reported pool-0 drained"
    assert drain.seq < drained < deleted_at(cluster, "pool-0")
    await cluster.wait_for(lambda: cluster.condition("Draining").get("reason") == "Drained")
    results = await results_once(broker, topics["results"], {r["request_id"] for r in produced})
    assert all(r.scheduling.executors == ["pool-0"] for r in results)


async def test_rolling_update_with_work_in_flight(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    await cluster.create(service_pool(broker, topics, replicas=2))
    await cluster.wait_for(cluster.ready, within_s=60)
    old_endpoints = pod_endpoints(cluster)
    produced = requests("roll", 8, max_tokens=100)
    await produce(broker.bootstrap, topics["requests"], produced)
    await poll_service(cluster, lambda m: sum(e.running_requests for e in m.executors) > 0)
    await cluster.patch_spec("pool", {"image": "registry.example/kvgate-executor:2"})

    def updated() -> bool:
        return cluster.ready() and all(
            p["spec"]["containers"][0]["image"].endswith(":2") for p in cluster.pods().values()
        )

    await cluster.wait_for(updated, within_s=60)
    # One executor at a time, highest slot first: drained, deleted, recreated, then the next.
    first_drain = cluster.admin.calls("POST")[0].seq
    order = sorted(
        [(c.seq, "drain", c.path.split("/")[3]) for c in cluster.admin.calls("POST")]
        + [(seq, "delete", name) for seq, name in operator_writes(cluster, "DELETE", "pods")]
        + [
            (seq, "create", name)
            for seq, name in operator_writes(cluster, "POST", "pods")
            if seq > first_drain
        ]
    )
    assert [(action, name) for _, action, name in order] == [
        (action, name) for name in ("pool-1", "pool-0") for action in ("drain", "delete", "create")
    ]
    for name in ("pool-1", "pool-0"):
        drained = cluster.admin.first_reported(name, ExecutorState.DRAINED)
        assert drained is not None and drained < deleted_at(cluster, name)
    # The service runs the new executors (new addresses), in live sessions.
    current = await poll_service(
        cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY] * 2
    )
    assert {e.name: e.endpoint for e in current.executors} == pod_endpoints(cluster)
    assert set(pod_endpoints(cluster).values()).isdisjoint(old_endpoints.values())

    await results_once(broker, topics["results"], {r["request_id"] for r in produced})


async def test_a_text_request_is_answered_with_the_executors_tokenizer(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """The operator's ConfigMap has the service take the tokenizer its executors serve: text
    and chat requests come back with text, tokenized and decoded as the executor's model does."""
    assert isinstance(cluster.kubelet, ProcessKubelet)
    served = word_tokenizer(tmp_path / "model", seed=1)
    cluster.kubelet.executor_args += ["--tokenizer", str(served)]
    await cluster.create(service_pool(broker, topics, replicas=1))
    await cluster.wait_for(cluster.ready, within_s=60)
    await poll_service(cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY])

    prompt = "w3 w14 w159 w7 w42"
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    sampling = {"ignore_eos": True, "seed": 1}
    produced = [
        {"request_id": "text-0", "prompt": prompt, "max_tokens": 6, "sampling": sampling},
        {"request_id": "chat-0", "messages": messages, "max_tokens": 5, "sampling": sampling},
    ]
    await produce(broker.bootstrap, topics["requests"], produced)
    results = {
        r.request_id: r for r in await results_once(broker, topics["results"], {"text-0", "chat-0"})
    }

    executors = Tokenizer.from_file(str(served))
    other = Tokenizer.from_file(str(word_tokenizer(tmp_path / "other", seed=2)))
    for result in results.values():
        assert result.output_token_ids
        assert result.text == executors.decode(result.output_token_ids)
        # A service that tokenized with any other vocabulary would say something else.
        assert result.text != other.decode(result.output_token_ids)
    text = results["text-0"]
    assert text.usage.prompt_tokens == len(executors.encode(prompt, add_special_tokens=False).ids)
    chat = results["chat-0"]
    rendered = "<user> w1 w2 w3 <assistant>"  # the executor's chat template
    assert chat.usage.prompt_tokens == len(executors.encode(rendered, add_special_tokens=False).ids)


@pytest.mark.timeout(180)
async def test_a_smollm2_pool_answers_a_chat_request_with_text(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    """The packaged SmolLM2 run by the pod's own `kvgate executor` command (on the CPU): the
    service takes its tokenizer and chat template from it and answers in words."""
    gguf = packaged_gguf()
    if gguf is None:
        pytest.skip(f"the packaged SmolLM2 is not installed ({INSTALL_HINT})")
    assert isinstance(cluster.kubelet, ProcessKubelet)
    cluster.kubelet.real_executors = True
    model = {"family": "llama", "packaged": "SmolLM2-135M-Instruct"}
    pool = service_pool(broker, topics, replicas=1, model=model, kvCache={"numBlocks": 64})
    await cluster.create(pool)
    await cluster.wait_for(cluster.ready, within_s=120)
    await poll_service(cluster, lambda m: [e.state for e in m.executors] == [ExecutorState.READY])

    question = [{"role": "user", "content": "What is the capital of France?"}]
    request = {"request_id": "smol-0", "messages": question, "max_tokens": 12}
    await produce(broker.bootstrap, topics["requests"], [request])
    [result] = await results_once(broker, topics["results"], {"smol-0"})

    tokenizer, _ = build_tokenizer(GgufFile(gguf).metadata)  # the file's own vocabulary
    assert result.text == tokenizer.decode(result.output_token_ids, skip_special_tokens=True)
    assert "Paris" in (result.text or ""), result.text


async def test_autoscaling_from_zero_and_back_loses_no_request(
    cluster: ServiceCluster,
    operator: KopfRunner,
    broker: EmbeddedBroker,
    topics: dict[str, str],
) -> None:
    """A pool at zero executors wakes on its first requests, grows with the real service's
    consumer lag, and goes back to zero once idle; every request is answered exactly once."""
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 3,
        "targetConsumerLagPerExecutor": 4,
        "scaleDownStabilizationSeconds": 1,
        "scaleToZeroAfterSeconds": 1,
        "syncPeriodSeconds": 1,
    }
    await cluster.create(service_pool(broker, topics, replicas=0, autoscaling=autoscaling))
    await cluster.wait_for(lambda: cluster.status().get("autoscaling") is not None, 60)
    assert not cluster.pods()

    produced = requests("burst", 12, max_tokens=60)  # lag 12: three executors
    await produce(broker.bootstrap, topics["requests"], produced)
    await cluster.wait_for(lambda: len(cluster.pods()) == 3, within_s=60)
    results = await results_once(broker, topics["results"], {r["request_id"] for r in produced})
    assert all(len(r.output_token_ids) == 60 for r in results)
    assert cluster.events("ScaledUp")

    # Idle: back to zero, each executor drained before its pod went.
    await cluster.wait_for(lambda: not cluster.pods(), within_s=60)
    assert cluster.pool("pool")["spec"]["replicas"] == 0
    assert cluster.events("ScaledDown")

    # And woken again by the next request.
    again = requests("again", 2, max_tokens=8)
    await produce(broker.bootstrap, topics["requests"], again)
    answered = await results_once(
        broker, topics["results"], {r["request_id"] for r in produced + again}
    )
    assert {r.request_id for r in answered} >= {"again-0", "again-1"}
