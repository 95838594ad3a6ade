"""Build a tiny, real, random-weight llama model offline.

The model is small enough to build in well under a second and to serve on a
CPU, yet it is a genuine ``mlx_lm`` llama checkpoint with a genuine Hugging
Face fast tokenizer, so both ``mlx_lm.server`` and ``vllm-mlx serve`` load and
serve it like any downloaded model. Tests, integration tests and the demo use
it; nothing is downloaded.

Geometry (``MODEL_VERSION`` 1): hidden 64, 2 layers, 4 attention heads,
2 KV heads, **head_dim 64** (so group-64 KV quantization is legal),
vocab 1024, fp16, untied LM head, ``max_position_embeddings`` 8192.
One token of KV cache is 2 layers x 2 (K, V) x 2 heads x 64 x 2 bytes = 1 KiB.

Weights are drawn with NumPy from ``seed`` (one generator per tensor name), so
they do not depend on mlx's RNG or on mlx-lm's initialisers. The tokenizer is
a byte-level BPE trained with ``tokenizers`` on :data:`kvplugin.tools.models.corpus.CORPUS`.
Building twice with the same seed gives byte-identical weights and tokenizer
files (for the same ``tokenizers`` version).

Special tokens and tokens that are not printable UTF-8 on their own (lone
bytes, control characters) have zero LM-head rows, so they never win a greedy
step (and are practically never sampled). Hence the model does not stop by
itself: generation runs to ``max_tokens`` (finish reason ``"length"``), and
its output is printable gibberish made of corpus fragments that differs
between prompts.

Command line: ``python -m kvplugin.tools.models.tiny [DIR] [--seed N] [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Iterator

from kvplugin.home import kvplugin_home

__all__ = [
    "MODEL_VERSION",
    "SERVED_MODEL_NAME",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "CHAT_TEMPLATE",
    "model_config",
    "build_tiny_model",
    "default_model_dir",
    "is_complete",
]

#: Bump when anything that changes the built files changes (geometry, corpus,
#: weight scheme, tokenizer settings). Part of the default cache path.
MODEL_VERSION = 1

#: The name tests pass to ``vllm-mlx serve --served-model-name``.
SERVED_MODEL_NAME = "tinyllama"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)  # ids 0..5

VOCAB_SIZE = 1024
HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE_SIZE = 256
MAX_POSITION_EMBEDDINGS = 8192

# Transformers renders chat templates with trim_blocks/lstrip_blocks, so all
# literal text (and every newline) is emitted through expressions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_MARKER = ".kvplugin-tiny-model"
_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def default_model_dir() -> Path:
    """Per-user cache location of the tiny model: ``<kvplugin_home()>/tiny-model-v<N>``."""
    return kvplugin_home() / f"tiny-model-v{MODEL_VERSION}"


def model_config() -> dict[str, Any]:
    """The ``config.json`` contents (a fresh dict)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


# --------------------------------------------------------------------------- #
# tokenizer


def _train_tokenizer():
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    from kvplugin.tools.models.corpus import CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    size = tok.get_vocab_size()
    if size != VOCAB_SIZE:  # corpus too small for the requested vocab
        raise RuntimeError(f"tokenizer trained to {size} tokens, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} is not id {i}")
    return tok


def _tokenizer_files(tok) -> dict[str, str]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": list(ROLE_TOKENS),
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special_tokens_map, indent=2) + "\n",
    }


# --------------------------------------------------------------------------- #
# weights


def _unprintable_ids(tok) -> list[int]:
    """Ids the model must never produce: special tokens, and tokens whose bytes
    are not printable UTF-8 text on their own (lone bytes >= 0x80, controls)."""
    from tokenizers import pre_tokenizers

    byte_of = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    assert len(byte_of) == 256 and set(byte_of) == set(pre_tokenizers.ByteLevel.alphabet())
    banned = []
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if token in SPECIAL_TOKENS:
            banned.append(idx)
            continue
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            banned.append(idx)
            continue
        if not all(c.isprintable() or c in " \n" for c in text):
            banned.append(idx)
    return sorted(banned)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (index = byte value)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = [], 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def _weights(seed: int, shapes: dict[str, tuple[int, ...]], banned: list[int]) -> dict[str, Any]:
    """NumPy float16 arrays for every parameter, independent of mlx's RNG."""
    import numpy as np

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):
            w = np.ones(shape, dtype=np.float32)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape, dtype=np.float32)
        else:  # linear weights, (out, in)
            # gain > 1 keeps attention/MLP output comparable to the residual;
            # the LM head's gain makes logits spread (std ~3) so that a zero
            # row (logit 0) is practically never sampled either.
            gain = 3.0 if name == "lm_head.weight" else 2.0
            w = rng.standard_normal(shape, dtype=np.float32) * (gain / np.sqrt(shape[-1]))
            if name == "lm_head.weight":
                w[banned] = 0.0
        out[name] = w.astype(np.float16)
    return out


def _build_model(seed: int, banned: list[int]):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    cfg = model_config()
    model = Model(ModelArgs.from_dict(cfg))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    weights = _weights(seed, shapes, banned)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model, cfg


# --------------------------------------------------------------------------- #
# build / reuse


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, *, seed: int | None = None) -> bool:
    """True if ``directory`` holds a finished build of this ``MODEL_VERSION``
    (and of ``seed``, if given) whose files match the marker's sizes."""
    directory = Path(directory)
    marker = _read_marker(directory)
    if not isinstance(marker, dict) or marker.get("version") != MODEL_VERSION:
        return False
    if seed is not None and marker.get("seed") != seed:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or set(files) != set(_FILES):
        return False
    for name, meta in files.items():
        try:
            if (directory / name).stat().st_size != meta["size"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
    return True


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Serialise concurrent builders of ``directory`` (a lock file beside it; POSIX only)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def build_tiny_model(directory: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Create the tiny model in ``directory`` (created if needed) and return it.

    A complete build for the same ``seed`` and ``MODEL_VERSION`` is reused
    (the marker file ``.kvplugin-tiny-model`` is written last); an incomplete
    or different one is rebuilt in place, as is any build when ``force``.
    Safe against concurrent callers on the same directory.
    """
    directory = Path(directory).expanduser().resolve()
    if not force and is_complete(directory, seed=seed):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        if not force and is_complete(directory, seed=seed):
            return directory  # another process finished it while we waited
        (directory / _MARKER).unlink(missing_ok=True)
        for name in _FILES:
            (directory / name).unlink(missing_ok=True)
        for stale in directory.glob("model-*.safetensors"):
            stale.unlink()

        from mlx_lm.utils import save_config, save_model

        tok = _train_tokenizer()
        for name, text in _tokenizer_files(tok).items():
            _write(directory / name, text)
        model, cfg = _build_model(seed, _unprintable_ids(tok))
        save_model(directory, model)
        save_config(cfg, config_path=directory / "config.json")
        gen_cfg = {
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
            "do_sample": False,
        }
        _write(directory / "generation_config.json", json.dumps(gen_cfg, indent=2) + "\n")

        missing = [n for n in _FILES if not (directory / n).is_file()]
        if missing:
            raise RuntimeError(f"tiny model build did not write {missing} in {directory}")
        marker = {
            "version": MODEL_VERSION,
            "seed": seed,
            "files": {
                n: {"size": (directory / n).stat().st_size, "sha256": _sha256(directory / n)}
                for n in _FILES
            },
        }
        _write(directory / _MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return directory


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvplugin.tools.models.tiny",
        description="Build the tiny random-weight llama model used by kvplugin's tests.",
    )
    p.add_argument("directory", nargs="?", type=Path, default=None,
                   help=f"target directory (default: {default_model_dir()})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = p.parse_args(argv)
    target = args.directory if args.directory is not None else default_model_dir()
    print(build_tiny_model(target, seed=args.seed, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(_main())


def build_derived_model(directory: Path, seed: int, make: Any, *, label: str) -> Path:
    """Build (once) a model that shares the tiny model's tokenizer but not its weights.

    ``make(directory, tiny_config)`` writes ``config.json`` and the weights; this writes the
    tokenizer files, takes the build lock and writes the completeness marker last, so a
    half-built directory is rebuilt. Used by the KV-heavy and the family models.
    """
    import shutil

    directory = Path(directory).expanduser().resolve()
    marker = directory / ".kvplugin-derived-model"

    def complete() -> bool:
        try:
            return json.loads(marker.read_text()) == {"label": label, "seed": seed}
        except (OSError, ValueError):
            return False

    if complete():
        return directory
    with build_lock(directory):
        if complete():
            return directory
        tiny = build_tiny_model(directory.parent / f".{directory.name}-tokenizer")
        directory.mkdir(parents=True, exist_ok=True)
        for f in tiny.iterdir():
            if f.suffix == ".json" and f.name not in ("config.json",
                                                      "model.safetensors.index.json"):
                shutil.copy(f, directory / f.name)
        make(directory, json.loads((tiny / "config.json").read_text()))
        marker.write_text(json.dumps({"label": label, "seed": seed}))
    return directory
