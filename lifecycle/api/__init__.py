"""The HTTP and WebSocket faces of the core: SGLang-native ``/generate``, the OpenAI API,
the WebSocket protocol, API keys, the operational routes and Prometheus metrics.

Handlers read the request and check its body at the edge (the OpenAI and embeddings
bodies and replies are ``lifecycle.faces``', shared with the Engine), then hand a
``GenerateRequest`` to ``lifecycle.core.frontend.Frontend`` inside one ``async with``
scope.
"""
