"""The value sets the chart is rendered with: defaults, everything enabled, cluster-wide,
standalone, and a custom release name and namespace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SASL_SSL_KAFKA: dict[str, Any] = {
    "bootstrapServers": "kafka-0.kafka.data:9093,kafka-1.kafka.data:9093",
    "topics": {"requests": "llm.requests", "results": "llm.results", "tokens": "llm.tokens"},
    "groupId": "kvgate-serving",
    "createTopics": True,
    "security": {
        "protocol": "SASL_SSL",
        "sasl": {
            "mechanism": "SCRAM-SHA-512",
            "username": "kvgate",
            "passwordSecret": {"name": "kafka-user", "key": "password"},
        },
        "tls": {"secretName": "kafka-ca", "ca": "ca.crt"},
    },
}

PROMETHEUS_PEER: dict[str, Any] = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


@dataclass(frozen=True)
class ValueSet:
    name: str
    release: str = "kvgate"
    namespace: str = "kvgate"
    values: dict[str, Any] = field(default_factory=dict)


VALUE_SETS: tuple[ValueSet, ...] = (
    ValueSet("defaults"),
    ValueSet(
        "everything",
        namespace="kvgate-system",
        values={
            "images": {
                "registry": "registry.example.com/ml",
                "pullSecrets": ["registry"],
                "operator": {"digest": "sha256:" + "ab" * 32},
                "executor": {"tag": "0.1.0-cu13"},
            },
            "operator": {
                "watch": {"namespaces": ["serving", "batch"]},
                "verbose": True,
                "settings": {"pollIntervalS": 2.5, "requestTimeoutS": 20},
                "podAnnotations": {"example.com/team": "inference"},
                "podLabels": {"example.com/tier": "control"},
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "tolerations": [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 1,
                                "preference": {
                                    "matchExpressions": [
                                        {"key": "pool", "operator": "In", "values": ["system"]}
                                    ]
                                },
                            }
                        ]
                    }
                },
                "priorityClassName": "system-cluster-critical",
                "podDisruptionBudget": {"maxUnavailable": "100%"},
            },
            "serviceAccount": {"annotations": {"example.com/role": "kvgate"}},
            "networkPolicy": {"enabled": True, "metricsFrom": [PROMETHEUS_PEER]},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "kafka": SASL_SSL_KAFKA,
            "examplePool": {
                "enabled": True,
                "name": "ouro",
                "namespace": "serving",
                "spec": {
                    "replicas": 2,
                    "model": {
                        "family": "looped",
                        "volume": {
                            "persistentVolumeClaim": {"claimName": "models"},
                            "subPath": "ouro-1.4b",
                        },
                        "loops": 4,
                        "exitPolicy": "gate",
                    },
                    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "kvCache": {"memoryFraction": 0.9, "hostSnapshotBlocks": 4096},
                    "scheduler": {"maxNumSeqs": 128, "preemption": "auto", "mode": "mixed"},
                    "tenants": {
                        "quotas": {"team-a": {"tokensPerMinute": 2000000}},
                        "defaultQuota": {"tokensPerMinute": 200000, "burstTokens": 400000},
                    },
                    "telemetry": {"otlpEndpoint": "http://otel-collector.observability:4318"},
                    "tokenSecret": {"name": "ouro-executor-token", "key": "token"},
                    "drainTimeoutSeconds": 600,
                },
            },
        },
    ),
    ValueSet(
        "cluster-wide",
        values={
            "operator": {"watch": {"allNamespaces": True}},
            "networkPolicy": {"enabled": True, "namespaces": ["serving"]},
            "serviceMonitor": {"enabled": True},
            "kafka": {"bootstrapServers": "kafka.data:9092", "createTopics": True},
            "examplePool": {"enabled": True, "namespace": "serving"},
        },
    ),
    ValueSet(
        "standalone",
        values={
            "operator": {
                "replicas": 0,
                "peering": {"enabled": False},
                "podDisruptionBudget": {"enabled": False},
            },
            "serviceAccount": {"create": False, "name": "existing-operator-account"},
            "examplePool": {"enabled": True, "createTokenSecret": False},
            "kafka": {"bootstrapServers": "kafka:9092"},
        },
    ),
    ValueSet(
        "gateway",
        namespace="serving",
        values={
            "networkPolicy": {"enabled": True, "metricsFrom": [PROMETHEUS_PEER]},
            "kafka": {"bootstrapServers": "kafka-0.kafka.data:9092"},
            "gateway": {
                "enabled": True,
                "model": "smollm2",
                "telemetry": {"otlpEndpoint": "http://otel-collector.observability:4317"},
                "apiKeys": {"secretName": "gateway-keys"},
                "tokenizer": {
                    "volume": {"persistentVolumeClaim": {"claimName": "models"}},
                    "path": "smollm2/tokenizer.json",
                },
                "ingress": {
                    "enabled": True,
                    "className": "nginx",
                    "host": "llm.example.com",
                    "tlsSecretName": "llm-tls",
                },
                "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
                "networkPolicy": {"from": [PROMETHEUS_PEER]},
            },
        },
    ),
    ValueSet(
        "gateway-secure-kafka",
        namespace="serving",
        values={
            "kafka": SASL_SSL_KAFKA,
            "gateway": {
                "enabled": True,
                "replicas": 3,
                "allowAnonymous": True,
                "http": {"maxBodyBytes": 4194304, "headTimeoutS": 5, "bodyTimeoutS": 60},
                # Its own principal: mutual TLS with a client certificate, no SASL.
                "kafkaSecurity": {
                    "protocol": "SSL",
                    "tls": {
                        "secretName": "gateway-kafka-tls",
                        "ca": "ca.pem",
                        "certificate": "client.pem",
                        "privateKey": "client-key.pem",
                    },
                },
            },
        },
    ),
    ValueSet(
        # Batches fed by a Deployment of their own, the store's credentials from a Secret, the
        # feeder and the gateway on SASL/TLS Kafka (tests/chart/test_chart_batches.py).
        "batches",
        namespace="serving",
        values={
            "networkPolicy": {"enabled": True, "metricsFrom": [PROMETHEUS_PEER]},
            "kafka": SASL_SSL_KAFKA,
            "gateway": {
                "enabled": True,
                "model": "smollm2",
                "apiKeys": {"secretName": "gateway-keys"},
                "tokenizer": {
                    "volume": {"persistentVolumeClaim": {"claimName": "models"}},
                    "path": "smollm2/tokenizer.json",
                },
            },
            "batches": {
                "enabled": True,
                "feeder": "deployment",
                "s3": {
                    "endpoint": "http://s3.storage.svc:7070",
                    "bucket": "llm-batches",
                    "prefix": "prod/kvgate",
                    "allowHttp": True,
                    "credentialsSecret": {"name": "batch-s3", "accessKeyIdKey": "id"},
                },
                "priority": 50,
                "window": 16,
                "limits": {"maxFileBytes": 100000000, "maxFileLines": 20000},
                "partitions": 12,
                "feederDeployment": {"replicas": 3, "healthPort": 9001},
            },
        },
    ),
    ValueSet(
        "custom-release",
        release="llm-prod",
        namespace="inference",
        values={
            "networkPolicy": {"enabled": True},
            "serviceMonitor": {"enabled": True},
            "kafka": {"bootstrapServers": "kafka:9092"},
            "examplePool": {"enabled": True},
        },
    ),
)

BY_NAME = {value_set.name: value_set for value_set in VALUE_SETS}
