"""``python -m kvgate.executor.tensor_parallel.follower SPEC_JSON``: one of ranks 1..N-1,
started by ``kvgate executor --tensor-parallel-size N``. Exits 0 when rank 0 releases it, 1 when
a step fails or rank 0 is gone."""

from __future__ import annotations

import logging
import sys

from kvgate.executor.tensor_parallel.ranks import (
    RankSpec,
    build_rank_executor,
    follow,
    join_group,
    leave_group,
)

log = logging.getLogger("kvgate.executor.rank")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    spec = RankSpec.model_validate_json(argv[0])
    try:
        parallel, channel = join_group(spec)
        follow(build_rank_executor(spec, parallel), channel)
    except Exception:
        log.exception("rank %d failed", spec.rank)
        return 1
    leave_group()  # released by rank 0: every collective is done
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
