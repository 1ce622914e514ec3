"""The ways a step's model math runs besides the plain torch path: the fused native trunk,
captured decode graphs and piecewise graphs. A new backend goes here, with its row in
``modelfile/layer_spec.py``'s ``BACKENDS`` and its choice in ``gpu/runtime/runner.py``."""
