"""Example ExecutorPool specs shared by the schema and builder tests."""

from __future__ import annotations

from typing import Any

# Every section set, Kafka with SASL over TLS: a spec as a production pool might have it.
FULL_SPEC: dict[str, Any] = {
    "replicas": 4,
    "gpusPerExecutor": 2,
    "image": "registry.example/kvgate-executor:1",
    "imagePullPolicy": "Always",
    "imagePullSecrets": [{"name": "registry"}],
    "model": {
        "family": "looped",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}, "subPath": "ouro-1.4b"},
        "loops": 4,
        "dtype": "float16",
        "exitPolicy": "gate",
    },
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": 68719476736}},
    "nodeSelector": {"nvidia.com/gpu.product": "H100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        }
    },
    "kvCache": {"memoryFraction": 0.9, "hostSnapshotBlocks": 4096},
    "scheduler": {
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 4096,
        "prefillChunkSize": 512,
        "policy": "priority",
        "mode": "mixed",
        "preemption": "off",
        "watermarkRatio": 0.05,
        "snapshotBlockCostS": 1e-5,
    },
    "tenants": {
        "quotas": {"team-a": {"tokensPerMinute": 600000, "burstTokens": 1200000}},
        "defaultQuota": {"tokensPerMinute": 60000},
    },
    "kafka": {
        "bootstrapServers": "kafka-0:9093,kafka-1:9093",
        "topics": {"tokens": "kvgate.tokens"},
        "groupId": "kvgate-prod",
        "createTopics": True,
        "tokenRecords": "per_token",
        "security": {
            "protocol": "SASL_SSL",
            "sasl": {
                "mechanism": "SCRAM-SHA-512",
                "username": "kvgate",
                "passwordSecret": {"name": "kafka-user", "key": "password"},
            },
            "tls": {"secretName": "kafka-ca"},
        },
    },
    "telemetry": {"otlpEndpoint": "http://otel-collector:4318", "serviceName": "prod"},
    "tokenSecret": {"name": "executor-token", "key": "token"},
    "admission": {"replicas": 1, "image": "registry.example/kvgate-admission:1"},
    "drainTimeoutSeconds": 600,
}
