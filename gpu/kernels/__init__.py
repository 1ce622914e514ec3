"""The kernels every layer of the worker runs on: the C kernels in ``csrc/`` (built for this
CPU by ``native_build.py``), the Triton kernels, the choice between them (``--kernels``), the
host-side integer tensors a step is made of, and the CPU runtime's process-wide settings. A new
kernel goes here; it imports nothing else of ``gpu``."""
