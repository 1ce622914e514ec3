"""The HTTP and WebSocket faces of the core: SGLang-native ``/generate``, the OpenAI API,
the WebSocket protocol, API keys, the operational routes and Prometheus metrics.

Handlers parse and validate at the edge, then hand a ``GenerateRequest`` to
``lifecycle.core.frontend.Frontend`` inside one ``async with`` scope.
"""
