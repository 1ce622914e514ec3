"""The request core: a generation request from admission to its last chunk, without HTTP.

``states`` is the state table (equal to ``specs/lifecycle.json``), ``fsm`` the per-request
machine and the registry of live requests, ``buffers`` the bounded handoffs (admission
queue, output buffers), ``params`` and ``sampling`` what a request asks for, ``outputs``
and ``detok`` what it returns, ``frontend`` the one owner of every call, ``worker_client``
and ``wire_stream`` the credit-based link to the worker, ``supervisor`` the worker's
process and readiness.
"""
