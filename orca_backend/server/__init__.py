"""Triton server adapters: the two TritonPythonModel classes, the request/response contract, metrics.

The top layer: it imports the engine, never the other way round.
"""
