"""A deterministic simulation of the server (docs/faults.md, "The deterministic simulation").

``loop`` (virtual time, seeded schedule), ``net`` (in-memory connections), ``world``
(the real app and an in-process scripted worker on them), ``clients``, ``scenario``
(what a seed draws), ``invariants``, ``known`` (findings listed with their reason),
``mutations`` (broken builds that prove each invariant can fail), ``run`` and ``sweep``.
``python -m tests.dsim --seed N`` replays one seed with its trace.
"""
