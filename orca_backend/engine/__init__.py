"""The engine front: a thread-safe LLMEngine (add/abort requests, per-request output streams) over
the engine core, and the output processor (incremental detokenization, stop strings) beside it.
"""
