"""GPU executor: model weights, paged KV tensors and the step server."""
