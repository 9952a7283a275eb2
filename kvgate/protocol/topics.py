"""kvgate's default Kafka topic names (the service settings and the operator's CRD both start here).

```
kvgate.requests       key = request_id   value = InferenceRequest   header traceparent (W3C)
kvgate.results        key = request_id   value = InferenceResult    same partition as the request
kvgate.tokens         no key             value = TokenChunks        same partition (optional; a
                      step's chunks of the partition's requests, header kvgate-reply-kind:
                      tokens; per_token: key = request_id, value = TokenChunk)
kvgate.aborts         key = request_id   value = AbortRequest
kvgate.requests.dlq   key = original     value = original bytes     headers += kvgate-dlq-*
kvgate.replies.<id>   key = request_id   value = InferenceResult, or TokenChunks with no key (a
                      gateway's own reply topic, named in the request; header kvgate-reply-kind)
```
"""

from typing import Final

REQUESTS: Final = "kvgate.requests"
RESULTS: Final = "kvgate.results"
TOKENS: Final = "kvgate.tokens"
ABORTS: Final = "kvgate.aborts"
DEAD_LETTER: Final = "kvgate.requests.dlq"
REPLIES_PREFIX: Final = "kvgate.replies."
