"""What runs next to the weights: the model runner, its persistent input batch, the sampler, the K/V
pool, and the worker process's main loop."""
