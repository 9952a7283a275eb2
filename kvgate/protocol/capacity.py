"""The capacity rule: how many KV positions and blocks a request needs, and the length limit.

```
positions   0 ............ P-1 | P ............ P+M-2 | P+M-1
            [ prompt           | outputs[:-1]         )  outputs[-1]: sampled, never fed back
KV          written for positions [0, P + M - 1)       -> P + M - 1 positions
blocks      ceil((P + M - 1) / block_size) pages per plane, times the number of planes
limit       P + M - 1 <= max_model_len                 (the model attends over at most that)
```
The scheduler's feasibility and reservations, the admission service's placement, the
simulator and every executor's plan validator use these functions; none writes its own.
"""

from __future__ import annotations


def positions_needed(prompt_tokens: int, max_tokens: int) -> int:
    """KV positions a request of ``prompt_tokens`` may fill before it stops."""
    return prompt_tokens + max_tokens - 1


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages (blocks of one plane) that hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def blocks_for(prompt_tokens: int, max_tokens: int, *, block_size: int, num_planes: int) -> int:
    """Cache blocks a request needs at its full length, over every plane."""
    return pages_for(positions_needed(prompt_tokens, max_tokens), block_size) * num_planes


def length_problem(prompt_tokens: int, max_tokens: int, max_model_len: int | None) -> str | None:
    """Why the model cannot serve this length (None when it can, or when nothing limits it)."""
    needed = positions_needed(prompt_tokens, max_tokens)
    if max_model_len is None or needed <= max_model_len:
        return None
    return (
        f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) - 1 = {needed} "
        f"exceeds max_model_len ({max_model_len})"
    )
