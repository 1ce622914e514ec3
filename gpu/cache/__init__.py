"""The paged KV cache: blocks, prefix cache, attention over blocks, its size; layouts go here."""
