"""State traces: the tracer that observes every transition, the in-memory store and its
queries, the JSONL trace log, the ``lifecycle trace`` command and the ``/debug`` page."""
