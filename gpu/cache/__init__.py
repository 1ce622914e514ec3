"""The paged KV cache: block bookkeeping with the prefix cache (``blocks.py``), attention over
blocks (``kv_cache.py``) and how big it is made (``memory.py``). A new cache layout goes here."""
