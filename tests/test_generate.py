"""Generation with a KV cache: the cached steps give exactly the whole-sequence model's greedy tokens,
a model trained to copy continues a pattern, and sampling follows temperature and top-k."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FIXTURES, make_setup, single_device, tiny_config
from meshtrain import generate as generate_cli
from meshtrain.generation import generate, sample
from meshtrain.inference import forward_logits, load
from meshtrain.step.state import init_state, make_batches
from meshtrain.step.train_step import make_train_step


def test_cached_greedy_equals_the_full_forward_pass():
    """Prompts of three lengths (left-padded together) on fsdp=2 x tp=4 with kv heads replicated over
    tp: each new token is the argmax of the uncached model over prompt + tokens so far."""
    loaded = load(f"hf:{FIXTURES / 'llama31_tied'}", ["mesh.fsdp=2", "mesh.tp=4", "precision.compute=float32",
                                                      "train.global_batch=8"])
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [20]]
    new = generate(loaded.setup, loaded.params, prompts, max_new_tokens=6)
    for prompt, ids in zip(prompts, new):
        logits = np.asarray(forward_logits(loaded.setup, loaded.params, np.array([prompt + ids])))[0]
        steps = logits[len(prompt) - 1: -1]
        top2 = np.sort(steps, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-4).all(), "a near tie would make argmax order-dependent"
        assert steps.argmax(-1).tolist() == ids


def test_decoding_in_chunks_gives_the_same_tokens_and_reports_progress():
    """The decode runs as whole compiled chunks with a progress call after each: any chunk length gives
    the tokens of one long loop (greedy and sampled: token i's key is fold_in(seed key, i) either way)."""
    loaded = load(f"hf:{FIXTURES / 'llama31_tied'}", ["mesh.fsdp=2", "mesh.tp=4", "precision.compute=float32",
                                                      "train.global_batch=8"])
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [20]]
    for how in ({}, {"temperature": 0.9, "top_k": 5, "seed": 3}):
        heard = []
        whole = generate(loaded.setup, loaded.params, prompts, max_new_tokens=11, chunk=100, **how)
        chunked = generate(loaded.setup, loaded.params, prompts, max_new_tokens=11, chunk=3, progress=heard.append,
                           **how)
        assert chunked == whole and heard == [4, 7, 10, 11]
        assert all(len(ids) == 11 for ids in whole)


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """A tiny model trained to continue 4-token patterns ("qrstqrstq" -> "rstq..."), on one device."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    rows = [np.tile(rng.choice(letters, 4), 4) for _ in range(4096)]
    path = tmp_path_factory.mktemp("copy") / "tokens.npy"
    np.save(path, np.concatenate(rows).astype(np.uint16))
    cfg = single_device(tiny_config("model.vocab_size=256", "data.source=file", f"data.path={path}",
                                    "train.global_batch=32", "train.steps=120", "train.warmup_steps=5"))
    setup = make_setup(cfg, 1)
    batches, step = make_batches(setup), make_train_step(setup)
    state = init_state(setup)
    for i in range(cfg.train.steps):
        state, metrics = step(state, batches.batch(i))
    assert float(metrics["loss"]) < 1.2  # the floor is ~0.82: 4 of 16 tokens per row are unpredictable
    return cfg, state.params


def test_greedy_generation_of_a_model_trained_to_copy(copy_model):
    """Trained on one device, generated on fsdp=2 x tp=4 (parameters resharded)."""
    cfg, params = copy_model
    from meshtrain.config import build_config
    sharded = make_setup(build_config(cfg.to_dict() | {"mesh": {"fsdp": 2, "tp": 4}}, []), 8)
    params = jax.device_put(params, sharded.state_shardings.params)
    prompts = [list(b"qrstqrstq"), list(b"mnopm"), list(b"wxyzwx")]
    new = generate(sharded, params, prompts, max_new_tokens=7)
    assert [bytes(ids) for ids in new] == [b"rstqrst", b"nopmnop", b"yzwxyzw"]


def test_generate_command_on_a_hugging_face_directory(capsys):
    """Text in and out through the model's own tokenizer.json; greedy output equals the library's."""
    d = FIXTURES / "llama_sharded"
    assert generate_cli.main(["--checkpoint", f"hf:{d}", "--prompt", "Hello", "--temperature", "0",
                              "--max-new-tokens", "5", "precision.compute=float32"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    loaded = load(f"hf:{d}", ["precision.compute=float32"])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = generate(loaded.setup, loaded.params, [tok.encode("Hello").ids], max_new_tokens=5)[0]
    ids = ids[: ids.index(1)] if 1 in ids else ids  # the model's eos_token_id ends a sample
    assert printed == "Hello" + tok.decode(ids)


def test_sampling_follows_temperature_and_top_k():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]] * 4000))
    key = jax.random.key(1)
    assert sample(logits, key, 0.0, 0).tolist() == [3] * 4000
    assert sample(logits, key, 1.0, 1).tolist() == [3] * 4000  # top-1 is greedy
    freq = np.bincount(np.asarray(sample(logits, key, 1.0, 0)), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)  # 3 sigma of 4000 draws ~ 0.023
    cold = np.bincount(np.asarray(sample(logits, key, 0.25, 0)), minlength=4) / 4000
    p = np.array([0.1, 0.2, 0.3, 0.4]) ** 4
    np.testing.assert_allclose(cold, p / p.sum(), atol=0.03)
    top2 = np.bincount(np.asarray(sample(logits, key, 1.0, 2)), minlength=4) / 4000
    np.testing.assert_allclose(top2, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    assert (sample(logits, key, 1.0, 0) == sample(logits, key, 1.0, 0)).all()  # the key decides
