"""Rank layout and tensor-parallel collectives (NCCL on GPUs, gloo on CPU)."""
