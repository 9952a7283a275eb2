"""A fast stand-in executor for large simulations: it counts work instead of simulating K/V.

``SimExecutor`` computes every token from the K/V it reads through the block tables, which is
what the correctness tests need and costs about 0.4 ms per prefill token. Placement and fairness
benchmarks replay hundreds of thousands of prompt tokens over many executors, and only need the
scheduler's decisions, each request's tokens at the right positions and the work each step did.
This executor follows the plans' actions and rows (registrations, frees, swaps, fills, decode
passes) for plain models (one loop) and samples a token as a hash of (request, seed, position):
deterministic, independent of scheduling. It checks the cursor a row expects and nothing about
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.protocol.step import (
    DecodeOutcomes,
    ExecutorCounters,
    ExecutorInfo,
    SampledToken,
    StepPlan,
    StepResult,
)
from kvgate.protocol.stopping import StopRule
from kvgate.sim.hashing import mix, text_hash

_MAX_MODEL_LEN = 1 << 30


@dataclass(slots=True)
class _Counted:
    rid_hash: int
    seed: int
    stop: StopRule
    fill_length: int
    outputs: int  # outputs generated so far (including the ones it came with)
    cursor_position: int = 0
    finished: bool = False


class CountingExecutor:
    """One plain-model executor (``num_loops`` 1) that samples hashes; see the module docstring."""

    def __init__(
        self,
        *,
        name: str,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 32_000,
        host_snapshot_blocks: int = 0,
    ) -> None:
        self.name = name
        self._info = ExecutorInfo(
            executor_id=name,
            model_family="counting",
            num_loops=1,
            block_size=block_size,
            num_blocks=num_blocks,
            host_snapshot_blocks=host_snapshot_blocks,
            vocab_size=vocab_size,
            eos_token_id=None,
            max_model_len=_MAX_MODEL_LEN,
            kv_bytes_per_block=0,
        )
        self._vocab_size = vocab_size
        self._requests: dict[str, _Counted] = {}
        self._snapshots: dict[str, _Counted] = {}

    @property
    def info(self) -> ExecutorInfo:
        return self._info

    @property
    def counters(self) -> ExecutorCounters:
        return ExecutorCounters(
            num_requests=len(self._requests), num_snapshots=len(self._snapshots)
        )

    def execute(self, plan: StepPlan) -> StepResult:
        requests = self._requests
        for request_id in plan.free:
            requests.pop(request_id, None)
            self._snapshots.pop(request_id, None)
        for request_id in plan.swap_out:
            self._snapshots[request_id] = requests.pop(request_id)
        for new in plan.new_requests:
            outputs = len(new.output_token_ids)
            prompt_len = len(new.prompt_token_ids)
            requests[new.request_id] = _Counted(
                rid_hash=text_hash(new.request_id),
                seed=new.sampling.seed or 0,
                stop=StopRule.of(new.sampling, None),
                fill_length=prompt_len + outputs - 1 if outputs else prompt_len,
                outputs=outputs,
            )
        for swap in plan.swap_in:
            requests[swap.request_id] = self._snapshots.pop(swap.request_id)
        tokens: list[SampledToken] = []
        for row in plan.prefill_rows:
            request = requests[row.request_id]
            if not row.completes_fill:
                continue
            request.cursor_position = request.fill_length
            if request.outputs == 0:
                tokens.append(self._sample(row.request_id, request, row.token_end))
        ids: list[str] = []
        positions: list[int] = []
        skipped: list[str] = []
        for request_id in plan.decode.request_ids:
            request = requests[request_id]
            if request.finished:
                skipped.append(request_id)
                continue
            position = request.cursor_position
            ids.append(request_id)
            positions.append(position)
            tokens.append(self._sample(request_id, request, position + 1))
            request.cursor_position = position + 1
        return StepResult(
            step_id=plan.step_id,
            tokens=tokens,
            decode=DecodeOutcomes(
                request_ids=ids,
                positions=positions,
                depths=[1] * len(ids),
                exited=[True] * len(ids),
            ),
            skipped_request_ids=skipped,
            counters=self.counters,
        )

    def _sample(self, request_id: str, request: _Counted, position: int) -> SampledToken:
        token = mix(request.rid_hash, request.seed, position) % self._vocab_size
        request.outputs += 1
        if request.stop.finish_reason(request.outputs, token) is not None:
            request.finished = True
        return SampledToken.model_construct(
            request_id=request_id, position=position, token_id=token, exit_depth=1
        )
