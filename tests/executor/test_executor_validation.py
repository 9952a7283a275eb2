"""A malformed or inconsistent plan gets an error result naming the problem, and changes nothing:
not the KV tensors, not the requests, not the snapshots. The executor then goes on serving the
same requests to the same outputs as if the bad plan had never been sent."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from tests.executor.workloads import reference_outputs

BLOCK_SIZE = 4
NUM_BLOCKS = 64
R = 3  # the looped test model's loops

A = wire.NewRequest(
    request_id="a",
    prompt_token_ids=[3, 1, 4, 1, 5, 9],
    sampling=wire.SamplingParams(max_tokens=6),
    loops=wire.LoopParams(exit_threshold=0.5),
)
B = wire.NewRequest(
    request_id="b",
    prompt_token_ids=[2, 7, 1, 8, 2, 8, 1],
    sampling=wire.SamplingParams(temperature=0.9, seed=6, max_tokens=5),
    loops=wire.LoopParams(exit_threshold=0.5),
)


def _pages(first: int, count: int) -> list[list[int]]:
    """``count`` pages per plane: plane d gets ids first + d*count ... (disjoint per plane)."""
    return [[first + d * count + i for i in range(count)] for d in range(R)]


@dataclass
class Session:
    ex: Executor
    step: int = 0
    next_block: int = 0
    pages: dict[str, int] | None = None

    def plan(self, **fields: object) -> wire.StepPlan:
        self.step += 1
        return wire.StepPlan(step_id=self.step, **fields)  # type: ignore[arg-type]

    def run(self, **fields: object) -> wire.StepResult:
        result = self.ex.execute(self.plan(**fields))
        assert result.error is None, result.error
        return result

    def grow(self, rid: str, count: int) -> wire.BlockAppend:
        ids = _pages(self.next_block, count)
        self.next_block += R * count
        assert self.pages is not None
        self.pages[rid] = self.pages.get(rid, 0) + count
        return wire.BlockAppend(request_id=rid, new_block_ids=ids)


@pytest.fixture
def session(looped: LoadedModel) -> Session:
    """``a`` decoding (fill done, two decode passes, 3 pages), ``b`` halfway through a wavefront
    fill (chunk [0, 4) done at depth 1 only, 1 page), nothing swapped out."""
    ex = Executor(looped, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, host_snapshot_blocks=10)
    s = Session(ex, pages={})
    s.run(
        new_requests=[A, B],
        block_appends=[s.grow("a", 3), s.grow("b", 1)],
        prefill_rows=[
            wire.PrefillRow(
                request_id="a",
                token_start=0,
                token_end=6,
                depth_first=1,
                depth_last=R,
                completes_fill=True,
            ),
            wire.PrefillRow(
                request_id="b", token_start=0, token_end=4, depth_first=1, depth_last=1
            ),
        ],
    )
    for _ in range(2):
        s.run(decode=wire.DecodeRows(request_ids=["a"], positions=[None], depths=[None]))
    return s


def _finish(s: Session) -> dict[str, tuple[list[int], list[int]]]:
    """Drive both requests to completion; return every token the executor reported for them."""
    tokens: dict[str, list[wire.SampledToken]] = {"a": [], "b": []}
    fill_b = [
        wire.PrefillRow(request_id="b", token_start=0, token_end=4, depth_first=2, depth_last=2),
        wire.PrefillRow(request_id="b", token_start=4, token_end=7, depth_first=1, depth_last=1),
    ]
    s.run(block_appends=[s.grow("b", 1)])
    for rows in (
        fill_b,
        [
            wire.PrefillRow(
                request_id="b", token_start=0, token_end=4, depth_first=3, depth_last=3
            ),
            wire.PrefillRow(
                request_id="b", token_start=4, token_end=7, depth_first=2, depth_last=2
            ),
        ],
        [
            wire.PrefillRow(
                request_id="b",
                token_start=4,
                token_end=7,
                depth_first=3,
                depth_last=3,
                completes_fill=True,
            )
        ],
    ):
        for token in s.run(prefill_rows=rows).sampled_tokens():
            tokens[token.request_id].append(token)
    live = {"a", "b"}
    for _ in range(200):
        if not live:
            break
        appends = [s.grow(rid, 1) for rid in sorted(live)]
        result = s.run(
            block_appends=appends,
            decode=wire.DecodeRows(
                request_ids=sorted(live), positions=[None] * len(live), depths=[None] * len(live)
            ),
        )
        for token in result.sampled_tokens():
            tokens[token.request_id].append(token)
        live -= set(result.skipped_request_ids)
    return {
        rid: ([t.token_id for t in ts], [t.exit_depth for t in ts]) for rid, ts in tokens.items()
    }


def test_session_without_bad_plans_matches_reference(session: Session, looped: LoadedModel) -> None:
    prior = _prior_tokens(session)
    outputs = _finish(session)
    expected = reference_outputs(looped, [(A, 1), (B, 1)])
    assert _merge(prior, outputs) == expected


def _prior_tokens(s: Session) -> dict[str, tuple[list[int], list[int]]]:
    state = s.ex._requests["a"]
    return {"a": (list(state.outputs), list(state.exit_depths)), "b": ([], [])}


def _merge(
    prior: dict[str, tuple[list[int], list[int]]], later: dict[str, tuple[list[int], list[int]]]
) -> dict[str, tuple[list[int], list[int]]]:
    return {rid: (prior[rid][0] + later[rid][0], prior[rid][1] + later[rid][1]) for rid in prior}


def _row(
    rid: str, start: int, end: int, first: int, last: int, *, completes: bool = False
) -> wire.PrefillRow:
    return wire.PrefillRow(
        request_id=rid,
        token_start=start,
        token_end=end,
        depth_first=first,
        depth_last=last,
        completes_fill=completes,
    )


def _decode(rid: str, position: int | None = None, depth: int | None = None) -> wire.DecodeRows:
    return wire.DecodeRows(request_ids=[rid], positions=[position], depths=[depth])


# Each bad plan starts with valid actions (so a half-applied plan would show) and then one fault.
BAD_PLANS: dict[str, tuple[dict[str, object], wire.ErrorCode, str]] = {
    "free-unknown": ({"free": ["zzz"]}, wire.ErrorCode.UNKNOWN_REQUEST, "zzz"),
    "decode-unknown": (
        {
            "decode": wire.DecodeRows(
                request_ids=["a", "zzz"], positions=[None] * 2, depths=[None] * 2
            )
        },
        wire.ErrorCode.UNKNOWN_REQUEST,
        "zzz",
    ),
    "block-out-of-range": (
        {
            "block_appends": [
                wire.BlockAppend(request_id="a", new_block_ids=[[60], [61], [NUM_BLOCKS]])
            ]
        },
        wire.ErrorCode.BLOCK_OUT_OF_RANGE,
        f"block id {NUM_BLOCKS}",
    ),
    "append-wrong-planes": (
        {"block_appends": [wire.BlockAppend(request_id="a", new_block_ids=[[60], [61]])]},
        wire.ErrorCode.BAD_PLAN,
        "2 planes",
    ),
    "append-uneven-planes": (
        {"block_appends": [wire.BlockAppend(request_id="a", new_block_ids=[[60], [61, 62], [63]])]},
        wire.ErrorCode.BAD_PLAN,
        "different page counts",
    ),
    "append-reuses-own-block": (
        {"block_appends": [wire.BlockAppend(request_id="a", new_block_ids=[[0], [61], [62]])]},
        wire.ErrorCode.BAD_PLAN,
        "repeats a block id",
    ),
    "swap-in-without-snapshot": (
        {"swap_in": [wire.SwapIn(request_id="a", block_ids=_pages(40, 2))]},
        wire.ErrorCode.MISSING_SNAPSHOT,
        "no snapshot",
    ),
    "swap-in-wrong-page-count": (
        {"swap_out": ["a"], "swap_in": [wire.SwapIn(request_id="a", block_ids=_pages(40, 2))]},
        wire.ErrorCode.BAD_PLAN,
        "3 pages per plane",
    ),
    "host-budget-exceeded": (
        {"swap_out": ["a", "b"]},  # a: 3 pages x 3 planes fit in 10; b needs 3 more
        wire.ErrorCode.HOST_BUDGET_EXCEEDED,
        "needs 3 host blocks; 9 of 10",
    ),
    "duplicate-new-request": ({"new_requests": [A]}, wire.ErrorCode.BAD_PLAN, "already registered"),
    "token-out-of-vocab": (
        {"new_requests": [A.model_copy(update={"request_id": "c", "prompt_token_ids": [1, 999]})]},
        wire.ErrorCode.BAD_PLAN,
        "token id 999",
    ),
    "longer-than-model": (
        {
            "new_requests": [
                A.model_copy(
                    update={"request_id": "c", "sampling": wire.SamplingParams(max_tokens=5000)}
                )
            ]
        },
        wire.ErrorCode.BAD_PLAN,
        "max_model_len",
    ),
    "row-beyond-pages": (
        {"prefill_rows": [_row("b", 4, 7, 1, 1)], "free": ["a"]},
        wire.ErrorCode.BAD_PLAN,
        "pages",
    ),
    "row-skips-a-chunk": (
        {
            "block_appends": [wire.BlockAppend(request_id="b", new_block_ids=_pages(40, 1))],
            "prefill_rows": [_row("b", 5, 7, 1, 1)],
        },
        wire.ErrorCode.BAD_PLAN,
        "filled up to 4, not 5",
    ),
    "wavefront-without-input": (
        {
            "block_appends": [wire.BlockAppend(request_id="b", new_block_ids=_pages(40, 1))],
            "prefill_rows": [_row("b", 4, 7, 2, 2)],
        },
        wire.ErrorCode.BAD_PLAN,
        "plane 2 is filled up to 0, not 4",
    ),
    "wavefront-wrong-range": (
        {"prefill_rows": [_row("b", 0, 3, 2, 2)]},
        wire.ErrorCode.BAD_PLAN,
        "no saved depth-1 output",
    ),
    "completes-fill-too-early": (
        {
            "block_appends": [wire.BlockAppend(request_id="b", new_block_ids=_pages(40, 1))],
            "prefill_rows": [_row("b", 4, 7, 1, 3, completes=True)],
        },
        wire.ErrorCode.BAD_PLAN,
        "plane 2 is filled up to 0",
    ),
    "depth-above-loops": (
        {
            "block_appends": [wire.BlockAppend(request_id="b", new_block_ids=_pages(40, 1))],
            "prefill_rows": [_row("b", 4, 7, 1, 4)],
        },
        wire.ErrorCode.BAD_PLAN,
        "3 loops",
    ),
    "prefill-after-fill": (
        {"prefill_rows": [_row("a", 0, 6, 1, 3)]},
        wire.ErrorCode.BAD_PLAN,
        "fill of a is complete",
    ),
    "decode-before-fill": ({"decode": _decode("b")}, wire.ErrorCode.BAD_PLAN, "before its fill"),
    "decode-wrong-position": (
        {"decode": _decode("a", position=3)},
        wire.ErrorCode.BAD_PLAN,
        "position 3",
    ),
    "decode-wrong-depth": ({"decode": _decode("a", depth=3)}, wire.ErrorCode.BAD_PLAN, "depth 3"),
    "two-rows-one-request": (
        {
            "decode": wire.DecodeRows(
                request_ids=["a", "a"], positions=[None] * 2, depths=[None] * 2
            )
        },
        wire.ErrorCode.BAD_PLAN,
        "more than one row",
    ),
    "swap-out-unknown": ({"swap_out": ["zzz"]}, wire.ErrorCode.UNKNOWN_REQUEST, "zzz"),
    "append-after-free": (
        {
            "free": ["a"],
            "block_appends": [wire.BlockAppend(request_id="a", new_block_ids=_pages(40, 1))],
        },
        wire.ErrorCode.UNKNOWN_REQUEST,
        "not resident",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_is_rejected_and_changes_nothing(
    session: Session, looped: LoadedModel, case: str
) -> None:
    fields, code, fragment = BAD_PLANS[case]
    ex = session.ex
    keys, values = ex.cache.keys.clone(), ex.cache.values.clone()
    counters, blocks_used = ex.counters, ex.blocks_used
    prior = _prior_tokens(session)

    result = ex.execute(session.plan(**fields))

    assert result.error is not None
    assert result.error.code == code, result.error
    assert fragment in result.error.message, result.error.message
    assert result.tokens == [] and result.decode == wire.DecodeOutcomes()
    assert torch.equal(ex.cache.keys, keys) and torch.equal(ex.cache.values, values)
    assert ex.counters == counters and ex.blocks_used == blocks_used
    # And it loses nothing: both requests finish exactly as without the bad plan.
    expected = reference_outputs(looped, [(A, 1), (B, 1)])
    assert _merge(prior, _finish(session)) == expected
