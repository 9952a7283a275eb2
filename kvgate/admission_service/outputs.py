"""What a finished output becomes in its result, beyond its tokens and text: tool calls, the
prompt's log-probabilities, and a scoring request's empty completion.

Applied to every finished result (``Answers``), in this order:

- ``max_tokens: 0`` scores the prompt only: the request ran with one output (the scheduler
  needs a token to finish on), which the result drops: no tokens, no text, ``length``;
- tools (``tool_calls.find_tool_calls``): the calls found, the text besides them, and
  ``finish_reason: tool_calls`` when the output ended by itself (a call cut short by
  ``max_tokens`` stays ``length``, with its text);
- ``prompt_logprobs``: one entry per prompt token from the fill rows' reports (the first token
  has no log-probability: nothing precedes it).
"""

from __future__ import annotations

from kvgate.admission_service.tokenizer import TextCodec, TokenizerError
from kvgate.admission_service.tool_calls import find_tool_calls
from kvgate.admission_service.tracking import Tracked, text_of
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import InferenceResult, PromptLogprob, TokenLogprob, Usage


def shaped(result: InferenceResult, tracked: Tracked, codec: TextCodec | None) -> InferenceResult:
    request = tracked.request
    update: dict[str, object] = {}
    if request.max_tokens == 0:
        update |= {
            "output_token_ids": [],
            "exit_depths": [],
            "text": "" if result.text is not None else None,
            "logprobs": [] if result.logprobs is not None else None,
            "finish_reason": FinishReason.LENGTH,
            "usage": Usage(prompt_tokens=result.usage.prompt_tokens, completion_tokens=0),
        }
    elif request.tools is not None and codec is not None and result.text is not None:
        update |= _tool_fields(result, tracked, codec)
    if request.prompt_logprobs is not None and tracked.choice == 0:
        update["prompt_logprobs"] = prompt_logprobs(tracked, codec)
    return result.model_copy(update=update) if update else result


def _tool_fields(result: InferenceResult, tracked: Tracked, codec: TextCodec) -> dict[str, object]:
    outputs = list(result.output_token_ids)
    if result.finish_reason is FinishReason.STOP and tracked.stop_text is None:
        outputs = outputs[:-1]  # the EOS (or stop token) that ended it is no part of a call
    try:
        raw = codec.decode_with_special(outputs)
        fmt = codec.tool_call_format()
    except TokenizerError:
        return {}
    assert result.text is not None
    found = find_tool_calls(tracked.request, result.text, raw, fmt, tracked.choice)
    if found is None or not found[1]:
        return {}
    content, calls = found
    ended = result.finish_reason is FinishReason.STOP
    return {
        "text": content,
        "tool_calls": calls,
        "finish_reason": FinishReason.TOOL_CALLS if ended else result.finish_reason,
    }


def prompt_logprobs(tracked: Tracked, codec: TextCodec | None) -> list[PromptLogprob]:
    def text(token_id: int) -> str | None:
        return text_of(codec, [token_id])

    entries = []
    for position, token_id in enumerate(tracked.spec.prompt_token_ids):
        score = tracked.prompt_scores.get(position)
        entries.append(
            PromptLogprob(
                token_id=token_id,
                logprob=score[0] if score is not None else None,
                token=text(token_id),
                top=[
                    TokenLogprob(token_id=t.token_id, logprob=t.logprob, token=text(t.token_id))
                    for t in (score[1] if score is not None else [])
                ],
            )
        )
    return entries
