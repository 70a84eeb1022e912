"""Hugging Face interop (Llama, OLMoE, Mixtral): config.json <-> model and moe fields (config.py; the reading
sits below, in meshtrain/config/from_hf.py), tensor names and layouts (mapping.py), safetensors <-> params
(weights.py).

Kept apart from the trainer so that `checkpoint.init_from=hf:DIR`, `python -m meshtrain.export` and the
inference commands share one mapping, tested against transformers' own logits (tests/fixtures/hf).
"""
