"""Benchmarks: the serving load generator (``serving``), the comparison harness
(``compare``) and the FastAPI baseline app (``baseline_fastapi``); see docs/benchmarks.md."""
