"""The APIs without HTTP: what an OpenAI or embeddings body asks and what its reply says,
and what ``/server_info`` reports; the HTTP routes (``lifecycle.api``) and the Engine
(``lifecycle.engine``) share them (docs/architecture.md)."""
