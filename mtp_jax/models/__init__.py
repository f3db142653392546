"""The network: a Llama-style trunk (layers.py, model.py), its MTP heads (heads.py), decode
attention (attention.py) and the KV cache (cache.py)."""
