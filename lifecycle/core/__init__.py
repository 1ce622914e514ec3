"""The request core: a generation request from admission to its last chunk, without HTTP.

``states`` is the state table (equal to ``specs/lifecycle.json``), ``fsm`` the
per-request machine that runs it, ``registry`` the live requests and their tombstones,
``buffers`` the bounded handoffs (admission queue, output buffers), ``params`` and
``sampling`` what a request asks for, ``outputs`` and ``detok`` what it returns,
``call`` the one owner of a generate call's requests, ``live_calls`` which calls are
live, ``frontend`` the process-wide parts a call uses, ``submission`` what the worker
holds for a prompt, ``worker_client`` and ``wire_stream`` the credit-based link to the
worker, ``supervisor`` the worker's process and readiness.
"""
