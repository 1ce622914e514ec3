"""The worker link: the process and socket side of the frontend (docs/architecture.md).

``wire_stream`` frames the wire protocol over a socket, ``worker_client`` is the
credit-based client of one worker (what the worker holds, its STEP frames into the
requests' buffers), ``supervisor`` spawns, warms up, watches and restarts a worker, and
``pool`` puts several behind one router (``--dp``). The request core
(``lifecycle.core``) reaches it only through the protocols of ``lifecycle.core.ports``.
"""
