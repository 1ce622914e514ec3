"""The request core: a generation request from admission to its last chunk, without HTTP.

``states`` is the state table (equal to ``specs/lifecycle.json``), ``fsm`` the
per-request machine that runs it, ``registry`` the live requests and their tombstones,
``buffers`` the bounded handoffs (admission queue, output buffers), ``params`` and
``sampling`` what a request asks for, ``outputs`` and ``detok`` what it returns,
``call_state`` a generate call's requests and samples without I/O, ``call`` the driver
that awaits around it (the one owner of the call), ``live_calls`` which calls are live,
``frontend`` the process-wide parts a call uses, ``submission`` what the worker holds
for a prompt, ``ports`` what the core needs of the worker link (``lifecycle.link``).
"""
