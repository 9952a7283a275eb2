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
