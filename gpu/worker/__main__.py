"""``python -m gpu.worker``: the worker process (``gpu/worker/process.py``)."""

import logging
import os
import sys

from gpu.worker.process import main

if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: native thread pools can abort the process while it runs
    # ("terminate called without an active exception", seen as exit -6 after SHUTDOWN).
    os._exit(code)
