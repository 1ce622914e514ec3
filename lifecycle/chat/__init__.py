"""The text side of chat, HTTP-free (docs/tools.md, docs/api.md "Reasoning"): each model
family's tool-call format (``tool_formats``), the streaming tool-call parser
(``tools``), the messages and tools a chat template renders (``tool_prompt``) and the
reasoning split (``reasoning``). The faces (``lifecycle.faces``, ``lifecycle.api``) and
the Engine use them; nothing here does I/O or imports ``transport``.
"""
