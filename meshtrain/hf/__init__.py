"""Hugging Face Llama interop: config.json <-> ModelConfig (config.py; the reading sits below, in
meshtrain/config/from_hf.py), safetensors <-> params (weights.py).

Kept apart from the trainer so that `checkpoint.init_from=hf:DIR`, `python -m meshtrain.export` and the
inference commands share one mapping, tested against transformers' own logits (tests/fixtures/hf).
"""
