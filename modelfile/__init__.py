"""What a GGUF model file says, without torch: the reader (``gguf_file``), the model's
config, its tokenizer and its chat template. Both the frontend (tokenize, detokenize,
render chats) and the worker (load weights) import it."""
