"""An embeddable HTTP/1.1 and WebSocket server on anyio, h11 and wsproto.

Knows nothing about models: it moves requests, responses, SSE events and WebSocket
messages, and enforces connection limits and timeouts.
"""
