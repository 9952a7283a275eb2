"""The OpenAI Batch API over Kafka: files in an object store, batch jobs whose state survives
restarts, and the feeder that turns a batch's lines into request records below interactive
traffic (docs/batch.md).

```
HTTP (gateway) ──▶ store: files/<file id>            (bytes, streamed)
               ──▶ kvgate.files    key file id        FileRecord      (compacted)
               ──▶ kvgate.batches  key batch/<id>     BatchRecord     (compacted; the creation)
                                   key cancel/<id>    CancelRecord
feeder (group member; a partition of kvgate.batches = the batches it owns)
               ──▶ kvgate.batches  key claim/<p>      ClaimRecord     (ownership epochs)
                                   key batch/<id>     BatchRecord     (progress, status)
               ──▶ kvgate.requests key <batch id>:<line>  InferenceRequest (reply: the batch
                                                       reply topic, partition p)
               ◀── kvgate.replies.batches / p             result copies
               ──▶ store: batches/<id>/segments/...   output and error lines, then the files
```

Modules: ``objects`` (OpenAI's shapes), ``journal`` (the compacted topics' records and their
fold), ``ids``, ``settings``, ``store`` / ``s3_store`` (bytes), ``jsonl`` (streamed lines),
``lines`` (a line as a request, an answer as an output line), ``segments``, ``run`` (one
batch), ``feeder`` (ownership, the reply partitions), ``book`` (the gateway's view).
"""
