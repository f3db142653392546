"""Serving: the Python API (api.py: Decoder, continuous batching) and the batch job (batch.py,
refill.py)."""
