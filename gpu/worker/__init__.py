"""The worker process (``python -m gpu.worker``): its options, its link, HELLO and STATS, its
CPU threads and runtime settings, and offline generation (``python -m gpu.worker.generate``)."""
