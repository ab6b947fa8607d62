"""Entry points, apart from the contracts: the offline LLM API (llm.py) and orca-serve (serve.py), a
real tritonserver on the model repository. Nothing is imported here, so `import
orca_backend.entrypoints.serve` stays light (no torch)."""
