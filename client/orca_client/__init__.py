"""Clients for the ORCA Triton models: streaming CLI and the A/B benchmark."""
