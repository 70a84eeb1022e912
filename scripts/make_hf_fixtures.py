"""Make the tiny Hugging Face fixtures under tests/fixtures/hf/ (needs torch and transformers).

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

Each fixture is a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads, plus
`reference.npz`: a token stream, the rows the model read (consecutive windows of that stream, the
layout of meshtrain's token-file windows) and transformers' fp32 logits for them. CI compares
meshtrain against these without torch. The shapes are chosen to hit every mapping case:

  llama31_tied    Llama-3.1 RoPE scaling (rope_type llama3, with frequencies in all three bands:
                  kept, smoothed and divided), tied embeddings, head_dim 16 != hidden/heads, GQA
                  with 2 kv heads (fewer than tp=4, so tp replicates them), vocab 61 (padded on tp)
  llama_sharded   plain RoPE, separate lm_head, GQA, weights in several safetensors files with
                  model.safetensors.index.json
  olmoe           OlmoeForCausalLM: q/k norm over the whole projections (k's over 2 kv heads), 4 experts,
                  top-2 softmax probabilities as they are (norm_topk_prob false)
  mixtral         MixtralForCausalLM: 4 experts, top-2 renormalized, head_dim 16 != hidden/heads, GQA,
                  rope_theta 1e6, no sliding window

Weights are drawn wider than transformers' init (std 0.15, norm scales near 1) so that attention
patterns and RoPE frequencies visibly move the logits: a wrong frequency fails a 1e-4 comparison.
For the MoE fixtures the seed is advanced until every token's k-th and (k+1)-th router probabilities
differ by at least ROUTER_MARGIN, so that summation order cannot flip an expert choice.
All carry a character-level tokenizer.json (61 symbols), so text commands work on them.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM)

SYMBOLS = list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + list(" .,!?'\n")
VOCAB = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(SYMBOLS)}}  # 61 tokens
ROWS, SEQ = 2, 12  # reference rows: windows of SEQ tokens of one stream of ROWS * SEQ + 1

COMMON = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1, attention_bias=False, mlp_bias=False, hidden_act="silu")

FIXTURES = {
    "llama31_tied": dict(
        COMMON, head_dim=16, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama_sharded": dict(COMMON, tie_word_embeddings=False,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "olmoe": dict({k: v for k, v in COMMON.items() if k != "mlp_bias"}, intermediate_size=32, tie_word_embeddings=False,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None, pad_token_id=None,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "mixtral": dict({k: v for k, v in COMMON.items() if k not in ("mlp_bias", "attention_bias")}, head_dim=16,
                    intermediate_size=32, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
}
CLASSES = {"olmoe": (OlmoeConfig, OlmoeForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM)}
ROUTER_MARGIN = 1e-3
SHARD_SIZE = {"llama_sharded": "40KB"}  # several files and an index


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return tok


def wide_model(name: str, seed: int):
    torch.manual_seed(seed)
    config_class, model_class = CLASSES.get(name, (LlamaConfig, LlamaForCausalLM))
    cfg = config_class(**FIXTURES[name])
    model = model_class(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return cfg, model


def router_margin(model, rows: np.ndarray, top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router probability, over tokens and layers."""
    logits = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: logits.append(out[0].detach()))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(torch.from_numpy(rows).long())
    for h in hooks:
        h.remove()
    assert len(logits) == model.config.num_hidden_layers
    probs = torch.sort(torch.softmax(torch.cat(logits), dim=-1), dim=-1, descending=True).values
    return float((probs[:, top_k - 1] - probs[:, top_k]).min())


def make(name: str, out: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, len(VOCAB), size=ROWS * SEQ + 1).astype(np.int32)
    rows = np.stack([stream[i * SEQ: (i + 1) * SEQ] for i in range(ROWS)])
    cfg, model = wide_model(name, seed)
    if name in CLASSES:
        while router_margin(model, rows, cfg.num_experts_per_tok) < ROUTER_MARGIN:
            seed += 100
            cfg, model = wide_model(name, seed)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.safetensors*"):
        old.unlink()
    model.save_pretrained(d, safe_serialization=True, max_shard_size=SHARD_SIZE.get(name, "10GB"))
    tokenizer().save(str(d / "tokenizer.json"))

    with torch.no_grad():
        logits = model(torch.from_numpy(rows).long()).logits.float().numpy()
    np.savez(d / "reference.npz", stream=stream, tokens=rows, logits=logits.astype(np.float32))
    files = sorted(p.name for p in d.iterdir())
    size = sum(p.stat().st_size for p in d.iterdir())
    print(f"{d}: {', '.join(files)} ({size / 1024:.0f} KiB); logits {logits.shape}; weights seed {seed}")


def made_with(readme: Path) -> dict[str, str]:
    """fixture -> the versions that made it, from the README this script wrote last (its one-line form
    before per-fixture lines named one pair for all)."""
    text = readme.read_text() if readme.is_file() else ""
    lines = dict(re.findall(r"^- (\w+): (.+)$", text, re.M))
    if not lines and (old := re.search(r"\((torch [^)]+)\)", text)):
        lines = dict.fromkeys(["llama31_tied", "llama_sharded"], old.group(1))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"))
    ap.add_argument("--only", nargs="+", choices=list(FIXTURES), help="remake these fixtures, keep the others "
                    "(another torch sums in another order: remade logits move by ~1e-7)")
    args = ap.parse_args()
    out = Path(args.out)
    versions = made_with(out / "README.md")
    for i, name in enumerate(FIXTURES):
        if args.only is None or name in args.only:
            make(name, out, seed=i)
            versions[name] = f"torch {torch.__version__}, transformers {__import__('transformers').__version__}"
    (out / "README.md").write_text(
        "Tiny random Hugging Face Llama, OLMoE and Mixtral models and transformers' fp32 logits for them, made by\n"
        "`scripts/make_hf_fixtures.py`. Regenerate with that script; do not edit by hand. Made with:\n"
        + "".join(f"- {name}: {versions[name]}\n" for name in FIXTURES if name in versions))


if __name__ == "__main__":
    main()
