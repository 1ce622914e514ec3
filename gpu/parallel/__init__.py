"""Tensor parallelism (--tp K): the ranks, and rank 0's steps told to its followers."""
