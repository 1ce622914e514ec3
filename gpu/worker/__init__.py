"""The worker process (python -m gpu.worker): options, link, HELLO, threads, offline generate."""
