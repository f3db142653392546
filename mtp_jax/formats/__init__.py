"""Files on disk: model directories and training checkpoints (checkpoint.py), HF import and
export (hf.py, hf_config.py), the tokenizer, and the cache folder (cache_dir.py)."""
