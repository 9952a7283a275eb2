"""OpenTelemetry names used by kvgate: span names and attribute keys, in one place.

``gen_ai.*`` where the OpenTelemetry semantic conventions define a key, ``kvgate.*`` otherwise.
Step spans (one per executor step) carry the ``kvgate.step.*`` and ``kvgate.kv.*`` keys below.
"""

from __future__ import annotations

from typing import Final

# ----------------------------------------------------------------------------- span names
STEP_SPAN: Final = "kvgate.step"

# ---------------------------------------------------------------------- step: identity
STEP_ID: Final = "kvgate.step.id"
EXECUTOR_ID: Final = "kvgate.executor.id"
STEP_ERROR_CODE: Final = "kvgate.step.error_code"

# -------------------------------------------------------------------------- step: rows
STEP_ROWS: Final = "kvgate.step.rows"
STEP_PREFILL_ROWS: Final = "kvgate.step.prefill_rows"
STEP_DECODE_ROWS: Final = "kvgate.step.decode_rows"
STEP_SKIPPED_ROWS: Final = "kvgate.step.skipped_rows"
STEP_PREFILL_TOKENS: Final = "kvgate.step.prefill_tokens"  # fill positions covered by the rows
STEP_DECODE_TOKENS: Final = "kvgate.step.decode_tokens"  # decode rows that ran
STEP_SAMPLED_TOKENS: Final = "kvgate.step.sampled_tokens"
# Token passes per depth: element d-1 counts positions that ran a core pass at depth d.
STEP_DEPTH_TOKEN_PASSES: Final = "kvgate.step.depth_token_passes"
STEP_MAX_DEPTH: Final = "kvgate.step.max_depth"
STEP_EXITED_ROWS: Final = "kvgate.step.exited_rows"  # decode rows whose token left the loop

# ----------------------------------------------------------------------- step: actions
STEP_NEW_REQUESTS: Final = "kvgate.step.new_requests"
STEP_FREES: Final = "kvgate.step.frees"
STEP_SWAP_OUTS: Final = "kvgate.step.swap_outs"
STEP_SWAP_INS: Final = "kvgate.step.swap_ins"
STEP_RECOMPUTES: Final = "kvgate.step.recomputes"  # new requests restoring by recompute
# Scheduling facts the admission service adds to its own step spans.
STEP_PREEMPTIONS: Final = "kvgate.step.preemptions"
STEP_RESTORE_MODES: Final = "kvgate.step.restore_modes"
STEP_BYPASSES: Final = "kvgate.step.bypasses"
# The bound and the margin: configured max_admission_bypasses, and the largest bypass count of a
# request bypassed in the step.
STEP_BYPASS_LIMIT: Final = "kvgate.step.bypass_limit"
STEP_MAX_BYPASSES: Final = "kvgate.step.max_bypasses"

# ------------------------------------------------------------------------ step: timing
STEP_EXECUTE_S: Final = "kvgate.step.execute_s"
STEP_KERNEL_S: Final = "kvgate.step.kernel_s"  # attention + KV write + plane copy kernels

# ------------------------------------------------------------------------------ kv cache
KV_BLOCKS_TOTAL: Final = "kvgate.kv.blocks_total"
KV_BLOCKS_USED: Final = "kvgate.kv.blocks_used"  # distinct blocks in resident block tables
KV_BLOCKS_FREE: Final = "kvgate.kv.blocks_free"
KV_HOST_BLOCKS_USED: Final = "kvgate.kv.host_blocks_used"
KV_SNAPSHOTS: Final = "kvgate.kv.snapshots"
KV_REQUESTS: Final = "kvgate.kv.requests"

# ------------------------------------------------------------------ request spans (gen_ai.*)
# One span per request in the admission service, named "{operation} {model}" as the GenAI
# semantic conventions ask, continuing the producer's trace context from the Kafka headers.
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_OPERATION_TEXT_COMPLETION: Final = "text_completion"
GEN_AI_OPERATION_CHAT: Final = "chat"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_PROVIDER: Final = "kvgate"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K: Final = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
ERROR_TYPE: Final = "error.type"
# Where the request came from (messaging conventions).
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_DESTINATION: Final = "messaging.destination.name"
MESSAGING_PARTITION: Final = "messaging.destination.partition.id"
MESSAGING_KAFKA_OFFSET: Final = "messaging.kafka.offset"
# The client's X-Request-Id (a tracing convention, not an idempotency key), on the gateway's
# span (HTTP conventions: http.request.header.<lower-case name>, a list of values).
HTTP_REQUEST_HEADER_X_REQUEST_ID: Final = "http.request.header.x-request-id"
# Scheduling facts of the request (kvgate's own namespace).
REQUEST_PRIORITY: Final = "kvgate.request.priority"
REQUEST_STATUS: Final = "kvgate.request.status"
REQUEST_REJECT_CODE: Final = "kvgate.request.reject_code"
REQUEST_QUEUED_S: Final = "kvgate.request.queued_s"
REQUEST_PREEMPTIONS: Final = "kvgate.request.preemptions"
REQUEST_RESTORES: Final = "kvgate.request.restores"
REQUEST_RESTORE_MODES: Final = "kvgate.request.restore_modes"
REQUEST_BYPASSES: Final = "kvgate.request.bypasses"
REQUEST_RECOMPUTED_TOKENS: Final = "kvgate.request.recomputed_tokens"
REQUEST_EXECUTORS: Final = "kvgate.request.executors"
# A drain moving a request's KV to another executor: one span event per attempt.
MIGRATION_EVENT: Final = "kvgate.migration"
MIGRATION_OUTCOME: Final = "kvgate.migration.outcome"  # migrated, or the fallback's reason
MIGRATION_SOURCE: Final = "kvgate.migration.source"
MIGRATION_TARGET: Final = "kvgate.migration.target"
MIGRATION_DETAIL: Final = "kvgate.migration.detail"
MIGRATION_BYTES: Final = "kvgate.migration.bytes"
MIGRATION_SECONDS: Final = "kvgate.migration.seconds"

# ------------------------------------------------------- admission-side step spans
# The admission service's span around one plan's round trip (kind CLIENT); the executor's
# kvgate.step span is its child through the plan's traceparent.
ADMISSION_STEP_SPAN: Final = "kvgate.step.round_trip"
STEP_ROUND_TRIP_S: Final = "kvgate.step.round_trip_s"
STEP_WAITING: Final = "kvgate.step.waiting"
STEP_RUNNING: Final = "kvgate.step.running"
STEP_ADMISSIONS: Final = "kvgate.step.admissions"
# The step's decisions by request id (what `kvgate replay --spans` compares): admitted (fresh or
# restored), given a prefill row, given a decode row, preempted.
STEP_ADMITTED_IDS: Final = "kvgate.step.admitted_ids"
STEP_PREFILL_IDS: Final = "kvgate.step.prefill_ids"
STEP_DECODE_IDS: Final = "kvgate.step.decode_ids"
STEP_PREEMPTED_IDS: Final = "kvgate.step.preempted_ids"
