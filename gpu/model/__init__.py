"""The model: weights loaded from a GGUF file or a Hugging Face folder, the decoder's math over
the layer description (``modelfile/layer_spec.py``), its linears (dense, quantized, or one
tensor-parallel rank's: ``linear.py``, ``shard.py``) and RoPE tables. A new
family is a row in ``modelfile/``; a new operation a spec field read by ``decoder.py``."""
