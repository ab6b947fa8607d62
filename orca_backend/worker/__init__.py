"""What runs next to the weights: the BatchMeta wire format, the model runner, the sampler, the K/V
pool, and the worker process's main loop."""
