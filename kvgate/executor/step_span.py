"""The attributes of a ``kvgate.step`` span (names from ``kvgate.telemetry.attributes``)."""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue

from kvgate.protocol import step as wire
from kvgate.telemetry import attributes as attr


def plan_attributes(plan: wire.StepPlan, info: wire.ExecutorInfo) -> dict[str, AttributeValue]:
    """What the plan asks for, known before it runs (a rejected plan's span carries these too)."""
    return {
        attr.STEP_ID: plan.step_id,
        attr.EXECUTOR_ID: info.executor_id,
        attr.STEP_ROWS: plan.num_rows,
        attr.STEP_PREFILL_ROWS: len(plan.prefill_rows),
        attr.STEP_DECODE_ROWS: len(plan.decode.request_ids),
        attr.STEP_PREFILL_TOKENS: sum(row.num_tokens for row in plan.prefill_rows),
        attr.STEP_NEW_REQUESTS: len(plan.new_requests),
        attr.STEP_RECOMPUTES: sum(1 for r in plan.new_requests if r.output_token_ids),
        attr.STEP_FREES: len(plan.free),
        attr.STEP_SWAP_OUTS: len(plan.swap_out),
        attr.STEP_SWAP_INS: len(plan.swap_in),
        attr.KV_BLOCKS_TOTAL: info.num_blocks,
    }


def result_attributes(
    result: wire.StepResult, token_passes_per_depth: list[int]
) -> dict[str, AttributeValue]:
    """What the step did: rows run and skipped, tokens, depths, timings."""
    deepest = max((d + 1 for d, n in enumerate(token_passes_per_depth) if n), default=0)
    return {
        attr.STEP_DECODE_TOKENS: len(result.decode.request_ids),
        attr.STEP_SKIPPED_ROWS: len(result.skipped_request_ids),
        attr.STEP_SAMPLED_TOKENS: result.num_tokens,
        attr.STEP_EXITED_ROWS: sum(result.decode.exited),
        attr.STEP_DEPTH_TOKEN_PASSES: token_passes_per_depth,
        attr.STEP_MAX_DEPTH: deepest,
        attr.STEP_EXECUTE_S: result.timings.execute_s,
        attr.STEP_KERNEL_S: result.timings.kernel_s or 0.0,
    }


def kv_attributes(
    *, blocks_total: int, blocks_used: int, host_blocks_used: int, snapshots: int, requests: int
) -> dict[str, AttributeValue]:
    """The cache as far as the executor knows it after the step."""
    return {
        attr.KV_BLOCKS_USED: blocks_used,
        attr.KV_BLOCKS_FREE: blocks_total - blocks_used,
        attr.KV_HOST_BLOCKS_USED: host_blocks_used,
        attr.KV_SNAPSHOTS: snapshots,
        attr.KV_REQUESTS: requests,
    }
