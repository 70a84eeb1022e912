"""Hugging Face Llama tensors <-> meshtrain parameters, through the safetensors library.

    HF tensor (torch Linear: [out, in])              meshtrain parameter (scanned: leading L axis)
    model.embed_tokens.weight   [V, D]               embedding        [Vp, D]   (Vp: V padded for tp)
    model.layers.i.self_attn.q_proj.weight [H*E, D]  layers/attn/wq   [L, D, H, E]
                           k_proj, v_proj  [K*E, D]  layers/attn/wk,wv[L, D, K, E]
                           o_proj          [D, H*E]  layers/attn/wo   [L, H, E, D]
    model.layers.i.mlp.gate_proj, up_proj  [F, D]    layers/mlp/w_gate,w_up [L, D, F]
                       down_proj           [D, F]    layers/mlp/w_down[L, F, D]
    model.layers.i.input_layernorm.weight  [D]       layers/attn_norm/scale [L, D]
    model.layers.i.post_attention_layernorm.weight   layers/mlp_norm/scale  [L, D]
    model.norm.weight           [D]                  final_norm/scale [D]
    lm_head.weight              [V, D]               lm_head          [D, Vp]  (absent when tied)

No permutation of q/k is needed: HF's Llama and meshtrain both rotate halves (pairs (i, i + E/2)).
Loading builds each parameter straight into its sharding on the mesh: every device's shard is cut
from one host copy of that tensor (`jax.make_array_from_callback`), one parameter at a time, so the
host holds at most one full parameter beyond what safetensors memory-maps.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import chex
import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from meshtrain.config import ConfigError, ModelConfig

INDEX = "model.safetensors.index.json"
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed, never loaded
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}



def _layer_table(m: ModelConfig) -> dict[tuple[str, ...], tuple[str, Callable, Callable]]:
    d, h, k, e = m.d_model, m.n_heads, m.n_kv_heads, m.kv_dim
    same = lambda x: x  # noqa: E731
    return {
        ("attn", "wq"): ("self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, e), lambda p: p.reshape(d, h * e).T),
        ("attn", "wk"): ("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, e), lambda p: p.reshape(d, k * e).T),
        ("attn", "wv"): ("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, e), lambda p: p.reshape(d, k * e).T),
        ("attn", "wo"): ("self_attn.o_proj.weight", lambda w: w.T.reshape(h, e, d), lambda p: p.reshape(h * e, d).T),
        ("mlp", "w_gate"): ("mlp.gate_proj.weight", lambda w: w.T, lambda p: p.T),
        ("mlp", "w_up"): ("mlp.up_proj.weight", lambda w: w.T, lambda p: p.T),
        ("mlp", "w_down"): ("mlp.down_proj.weight", lambda w: w.T, lambda p: p.T),
        ("attn_norm", "scale"): ("input_layernorm.weight", same, same),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", same, same),
    }


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama of this shape stores, with its HF shape."""
    d, h, k, e, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.kv_dim, m.d_ff, m.vocab_size
    per_layer = {"self_attn.q_proj.weight": (h * e, d), "self_attn.k_proj.weight": (k * e, d),
                 "self_attn.v_proj.weight": (k * e, d), "self_attn.o_proj.weight": (d, h * e),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
                 "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(m.n_layers):
        out.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
    if not m.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


# ------------------------------------------------------------------------------------------- reading


class SafetensorsDir:
    """The tensors of a Hugging Face directory: one `*.safetensors` file or several with their index."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self.at = f"checkpoint.init_from=hf:{self.directory}"
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {str(k): str(v) for k, v in dict(weight_map).items()}
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{self.at}: {INDEX} is not a safetensors index with a weight_map "
                                  f"({type(e).__name__}: {str(e)[:120]}); fix or remove it") from None
            for filename in sorted(set(self.where.values())):
                self._confined(filename)
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{self.at}: no *.safetensors files there (only "
                                  f"safetensors weights are read; convert .bin/.pth files with transformers first)")
            self.where = {name: f.name for f in files for name in self._open(f.name).keys()}

    def _confined(self, filename: str) -> Path:
        """`filename` as a regular file inside the model directory (the index is input: no `../`, no
        absolute paths, no links out, no pipes or devices that would hang or leak a read)."""
        root = self.directory.resolve()
        path = (self.directory / filename).resolve()
        if Path(filename).is_absolute() or root not in path.parents:
            raise ConfigError(f"{self.at}: {INDEX} names {filename!r}, outside the model directory; "
                              f"weight files must lie in it")
        if not path.is_file():  # follows links (confined above); False for pipes, devices, directories
            raise ConfigError(f"{self.at}: weight file {filename!r} is missing or not a regular file")
        return path

    def _open(self, filename: str):
        if filename not in self._handles:
            path = self._confined(filename)
            try:
                self._handles[filename] = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for a bad header)
                raise ConfigError(f"{self.at}: {filename} is not a readable safetensors file "
                                  f"({type(e).__name__}: {str(e)[:160]}); download it again") from None
        return self._handles[filename]

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.where[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """Tensor `name`, which must be floating point and finite."""
        filename = self.where[name]
        try:
            x = self._open(filename).get_tensor(name)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001  (a truncated file fails here, not at open)
            raise ConfigError(f"{self.at}: tensor {name} cannot be read from {filename} "
                              f"({type(e).__name__}: {str(e)[:160]}); download it again") from None
        if x.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
            raise ConfigError(f"{self.at}: tensor {name} is {x.dtype}; Llama weights are float32, float16 or "
                              f"bfloat16 (a quantized or foreign checkpoint?)")
        if not np.isfinite(np.asarray(x, np.float32)).all():
            raise ConfigError(f"{self.at}: tensor {name} holds NaN or infinite values; the model cannot start from it")
        return x

    def close(self) -> None:
        self._stack.close()


def check_tensors(src: SafetensorsDir, m: ModelConfig) -> None:
    """Every expected tensor present with its shape, nothing unexpected: one ConfigError listing all."""
    expected = hf_shapes(m)
    have = src.names()
    where = f"checkpoint.init_from=hf:{src.directory}"
    problems = [f"{where}: tensor {n} is missing" for n in sorted(set(expected) - have)]
    problems += [f"{where}: tensor {n} has shape {list(src.shape(n))}, config.json implies {list(s)}"
                 for n, s in sorted(expected.items()) if n in have and src.shape(n) != s]
    extra = sorted(n for n in have - set(expected) if not n.endswith(IGNORED)
                   and not (m.tie_embeddings and n == "lm_head.weight"))
    problems += [f"{where}: tensor {n} has no place in a Llama of this config (biases? another architecture?)"
                 for n in extra]
    if problems:
        raise ConfigError(problems)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)]) if rows > x.shape[0] else x


def host_params(src: SafetensorsDir, m: ModelConfig, abstract_params: Any) -> Iterator[tuple[tuple, np.ndarray]]:
    """(path in the params tree, fp32 host array in meshtrain's layout) for every leaf of `abstract_params`,
    one at a time. Padded vocabulary rows (columns of lm_head) are zero; their logits are masked anyway."""
    table = _layer_table(m)
    vocab_padded = abstract_params["embedding"].shape[0]
    scanned = "layer_0" not in abstract_params["layers"]
    f32 = lambda name: np.asarray(src.get(name), dtype=np.float32)  # noqa: E731
    yield ("embedding",), _pad_rows(f32("model.embed_tokens.weight"), vocab_padded)
    yield ("final_norm", "scale"), f32("model.norm.weight")
    if not m.tie_embeddings:
        yield ("lm_head",), _pad_rows(f32("lm_head.weight"), vocab_padded).T
    for sub, (hf_name, to_ours, _) in table.items():
        layers = [to_ours(f32(f"model.layers.{i}.{hf_name}")) for i in range(m.n_layers)]
        if scanned:
            yield ("layers",) + sub, np.stack(layers)
        else:
            for i, w in enumerate(layers):
                yield ("layers", f"layer_{i}") + sub, w


def load_params(directory: Path, m: ModelConfig, abstract_params: Any, shardings: Any) -> Any:
    """The parameters of a Hugging Face Llama, each created directly in its sharding (any mesh)."""
    src = SafetensorsDir(directory)
    try:
        check_tensors(src, m)
        out: dict = {}
        for path, host in host_params(src, m, abstract_params):
            leaf, sharding = _at(abstract_params, path), _at(shardings, path)
            chex.assert_shape(host, leaf.shape)  # the mapping above, not user input: checked already
            host = host.astype(leaf.dtype)
            _put(out, path, jax.make_array_from_callback(leaf.shape, sharding, lambda idx, h=host: h[idx]))
    finally:
        src.close()
    chex.assert_trees_all_equal_shapes_and_dtypes(out, abstract_params)
    return out


def _at(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _put(tree: dict, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------------------- writing


def hf_tensors(params: Any, m: ModelConfig, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Host params (numpy, meshtrain layout, padded vocabulary) -> HF tensors, padding removed."""
    table = _layer_table(m)
    cast = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(DTYPES[dtype]))  # noqa: E731
    v = m.vocab_size
    out = {"model.embed_tokens.weight": cast(params["embedding"][:v]),
           "model.norm.weight": cast(params["final_norm"]["scale"])}
    if not m.tie_embeddings:
        out["lm_head.weight"] = cast(np.asarray(params["lm_head"])[:, :v].T)
    layers = params["layers"]
    for sub, (hf_name, _, to_hf) in table.items():
        for i in range(m.n_layers):
            ours = _at(layers, sub)[i] if "layer_0" not in layers else _at(layers[f"layer_{i}"], sub)
            out[f"model.layers.{i}.{hf_name}"] = cast(to_hf(np.asarray(ours)))
    return out


def save_tensors(tensors: dict[str, np.ndarray], out_dir: Path, max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write safetensors files (several, with model.safetensors.index.json, past `max_shard_bytes`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}  # transformers checks the format tag of what it loads
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(out_dir / fname), metadata=meta)
        weight_map.update({t: fname for t in shard})
    total = sum(t.nbytes for t in tensors.values())
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX]
