"""Hugging Face tensors <-> meshtrain parameters, through the safetensors library (Llama, OLMoE, Mixtral:
the names and layouts are in mapping.py).

Loading builds each parameter straight into its sharding on the mesh (`jax.make_array_from_callback`),
one parameter at a time. A dense parameter's shards are cut from one host copy of it; an expert weight
[L, X, ...] is read per shard, only the layers and experts that shard holds, so the host never holds a
whole stack of experts (Mixtral-8x7B's w_gate alone is 60 GB in fp32).
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

from meshtrain.config import ConfigError, ModelConfig, MoEConfig
from meshtrain.hf.config import architecture
from meshtrain.hf.mapping import EXPERT, hf_shapes, layer_names, layer_table

__all__ = ["SafetensorsDir", "check_tensors", "hf_shapes", "hf_tensors", "load_params", "save_tensors"]

INDEX = "model.safetensors.index.json"
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed, never loaded
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# ------------------------------------------------------------------------------------------- reading


class SafetensorsDir:
    """The tensors of a Hugging Face directory: one `*.safetensors` file or several with their index."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._finite: set[str] = set()  # tensors checked already (an expert's is read once per shard holding it)
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
            raise ConfigError(f"{self.at}: tensor {name} is {x.dtype}; model weights are float32, float16 or "
                              f"bfloat16 (a quantized or foreign checkpoint?)")
        if name not in self._finite:
            if not np.isfinite(np.asarray(x, np.float32)).all():
                raise ConfigError(f"{self.at}: tensor {name} holds NaN or infinite values; the model cannot start "
                                  f"from it")
            self._finite.add(name)
        return x

    def close(self) -> None:
        self._stack.close()


def check_tensors(src: SafetensorsDir, m: ModelConfig, moe: MoEConfig | None = None) -> None:
    """Every expected tensor present with its shape, nothing unexpected: one ConfigError listing all."""
    expected = hf_shapes(m, moe)
    have = src.names()
    where = f"checkpoint.init_from=hf:{src.directory}"
    problems = [f"{where}: tensor {n} is missing" for n in sorted(set(expected) - have)]
    problems += [f"{where}: tensor {n} has shape {list(src.shape(n))}, config.json implies {list(s)}"
                 for n, s in sorted(expected.items()) if n in have and src.shape(n) != s]
    extra = sorted(n for n in have - set(expected) if not n.endswith(IGNORED)
                   and not (m.tie_embeddings and n == "lm_head.weight"))
    kind = architecture(m, moe, exact=False)
    problems += [f"{where}: tensor {n} has no place in a {kind} model of this config (biases? fused experts, which "
                 f"save_pretrained(save_original_format=False) writes? another architecture?)" for n in extra]
    if problems:
        raise ConfigError(problems)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)]) if rows > x.shape[0] else x


Reader = Callable[[tuple], np.ndarray]  # a leaf's index (one slice per axis) -> that block, fp32, meshtrain's layout


def host_params(src: SafetensorsDir, m: ModelConfig, abstract_params: Any,
                moe: MoEConfig | None = None) -> Iterator[tuple[tuple, Reader]]:
    """(path in the params tree, its Reader) for every leaf of `abstract_params`, one at a time. Padded
    vocabulary rows (columns of lm_head) are zero; their logits are masked anyway. A dense leaf is read whole
    once and cut; an expert leaf reads only the layers and experts of the asked block (module docstring)."""
    vocab_padded = abstract_params["embedding"].shape[0]
    scanned = "layer_0" not in abstract_params["layers"]
    n_experts = moe.n_experts if moe is not None and moe.enabled else 0
    f32 = lambda name: np.asarray(src.get(name), dtype=np.float32)  # noqa: E731
    cut = lambda host: lambda idx: host[idx]  # noqa: E731
    yield ("embedding",), cut(_pad_rows(f32("model.embed_tokens.weight"), vocab_padded))
    yield ("final_norm", "scale"), cut(f32("model.norm.weight"))
    if not m.tie_embeddings:
        yield ("lm_head",), cut(_pad_rows(f32("lm_head.weight"), vocab_padded).T)
    for sub, tensor in layer_table(m, moe).items():
        if EXPERT in tensor.name:
            def layer(i, idx_xa, tensor=tensor):  # one layer's experts idx_xa[0], each cut to idx_xa[1:]
                names = layer_names(tensor, i, n_experts)
                return np.stack([tensor.to_ours(f32(names[x]))[idx_xa[1:]] for x in range(n_experts)[idx_xa[0]]])
        else:
            layers = [tensor.to_ours(f32(layer_names(tensor, i, 0)[0])) for i in range(m.n_layers)]
            layer = lambda i, idx_a, layers=layers: layers[i][idx_a]  # noqa: E731
        if scanned:
            yield ("layers",) + sub, lambda idx, layer=layer: np.stack([layer(i, idx[1:])
                                                                        for i in range(m.n_layers)[idx[0]]])
        else:
            for i in range(m.n_layers):
                yield ("layers", f"layer_{i}") + sub, lambda idx, i=i, layer=layer: layer(i, idx)


def load_params(directory: Path, m: ModelConfig, abstract_params: Any, shardings: Any,
                moe: MoEConfig | None = None) -> Any:
    """The parameters of a Hugging Face model, each created directly in its sharding (any mesh)."""
    src = SafetensorsDir(directory)
    try:
        check_tensors(src, m, moe)
        out: dict = {}
        for path, read in host_params(src, m, abstract_params, moe):
            leaf, sharding = _at(abstract_params, path), _at(shardings, path)
            # make_array_from_callback checks each block's shape against its shard's (the mapping is ours,
            # config.json's shapes were checked above).
            block = lambda idx, read=read, leaf=leaf: read(idx).astype(leaf.dtype)  # noqa: E731
            _put(out, path, jax.make_array_from_callback(leaf.shape, sharding, block))
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


def hf_tensors(params: Any, m: ModelConfig, dtype: str = "float32", moe: MoEConfig | None = None
               ) -> dict[str, np.ndarray]:
    """Host params (numpy, meshtrain layout, padded vocabulary) -> the tensors of `architecture(m, moe)`,
    padding removed; one tensor per expert, as the Hub stores them."""
    cast = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(DTYPES[dtype]))  # noqa: E731
    v = m.vocab_size
    out = {"model.embed_tokens.weight": cast(params["embedding"][:v]),
           "model.norm.weight": cast(params["final_norm"]["scale"])}
    if not m.tie_embeddings:
        out["lm_head.weight"] = cast(np.asarray(params["lm_head"])[:, :v].T)
    layers = params["layers"]
    n_experts = moe.n_experts if moe is not None and moe.enabled else 0
    for sub, tensor in layer_table(m, moe).items():
        for i in range(m.n_layers):
            ours = np.asarray(_at(layers, sub)[i] if "layer_0" not in layers else _at(layers[f"layer_{i}"], sub))
            names = layer_names(tensor, i, n_experts)
            blocks = list(ours) if EXPERT in tensor.name else [ours]  # experts: [X, ...] -> X tensors
            out.update({name: cast(tensor.to_hf(block)) for name, block in zip(names, blocks, strict=True)})
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
