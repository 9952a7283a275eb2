"""The executor: model families, weights, paged KV tensors, the step runner and the sampler."""
