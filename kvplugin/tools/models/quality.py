"""A tiny *trained* causal LM for ``kvplugin bench --quality``, made reproducibly offline.

Why trained: quantization error in keys matters through attention, and random weights give
keys with no structure (no outlier channels, near-uniform attention), so a random model says
little about real ones. This module trains a small mlx-lm llama with ``mlx.optimizers`` on
text made locally from the corpus shipped in :mod:`kvplugin.tools.models.corpus` (nothing is
downloaded), on first use, and caches it (``~/.cache/kvplugin/quality-model-v1``).

Tokens: a word-level vocabulary of the shipped corpus (~550 entries, id 0 ``<unk>``), built
deterministically without any tokenizer library. A word per token carries far more text per
training step than bytes would, which matters on a CPU.

Data (all seeded; evaluation documents come from seeds and paragraphs never trained on):

* **stories**: paragraphs from a small template grammar over corpus words. Each paragraph
  fixes a cast (people, a place, a thing, adjectives, a number, a time) that its sentences
  keep reusing, so predicting them means retrieving words from earlier in the context through
  attention: what a reused prompt entry is for;
* **prose**: slices of the shipped corpus (its last two paragraphs are held out);
* **copy** documents (a random word sequence repeated; weight 0 by default: a model this
  small does not learn induction within the training budget).

Geometry (:data:`SPEC`): hidden 64, 2 layers, 2 query heads sharing 1 KV head, **head_dim 128**
(group sizes 32, 64 and 128 all divide it; 64 would rule out group 128), MLP 128, ~0.2 M
parameters, 256-token context; trained in fp32 for 200 steps of 6 x 256 tokens, evaluated in
fp16 (so the KV cache is fp16). mlx's Linux CPU backend multiplies matrices with a reference
BLAS, which is what bounds the model to this size (docs/benchmarks.md). The weights are not shipped:
this script is, and the same mlx version on the same kind of machine rebuilds the same
weights; the spec, losses and training time are recorded in ``quality-model.json``.

:data:`HYBRID_SPEC` (Qwen3-Next style: a GatedDeltaNet layer, then attention) is trained the
same way, for the codec of recurrent state (``kvplugin bench --quality --hybrid``).

Command line: ``python -m kvplugin.tools.models.quality [DIR] [--force] [--quick] [--hybrid]``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from kvplugin.home import kvplugin_home
from kvplugin.tools.models.tiny import build_lock

__all__ = [
    "ModelSpec",
    "SPEC",
    "QUICK_SPEC",
    "HYBRID_SPEC", "QUICK_HYBRID_SPEC",
    "default_model_dir",
    "build_quality_model",
    "load_quality_model",
    "encode",
    "decode",
    "train_documents",
    "heldout_documents",
    "copy_document",
    "copy_unit_range",
    "is_built",
]

_MARKER = "quality-model.json"
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines the trained weights (part of the cache check)."""

    version: int = 1
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 128
    intermediate_size: int = 128
    seq_len: int = 256
    batch_size: int = 6
    steps: int = 200
    lr: float = 5e-3
    warmup: int = 20
    weight_decay: float = 0.01
    copy_fraction: float = 0.0
    prose_fraction: float = 0.2
    seed: int = 0
    #: ``llama``, or ``qwen3_next``: GatedDeltaNet (recurrent state) and attention layers
    model_type: str = "llama"

    def model_config(self) -> dict[str, Any]:
        cfg = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-5,
            "vocab_size": len(vocabulary()),
            "max_position_embeddings": 4 * self.seq_len,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
        if self.model_type == "qwen3_next":  # a GatedDeltaNet layer before each attention one
            cfg.update(model_type="qwen3_next", rms_norm_eps=1e-6, linear_num_value_heads=2,
                       linear_num_key_heads=1, linear_key_head_dim=64, linear_value_head_dim=64,
                       linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
                       decoder_sparse_step=1, moe_intermediate_size=32, full_attention_interval=2,
                       shared_expert_intermediate_size=self.intermediate_size,
                       mlp_only_layers=list(range(self.num_layers)), partial_rotary_factor=0.25)
        return cfg

    def fingerprint(self) -> str:
        # (the llama's builds predate model_type: its fingerprint leaves it out)
        fields = {k: v for k, v in asdict(self).items() if (k, v) != ("model_type", "llama")}
        blob = json.dumps(fields, sort_keys=True) + _corpus_hash()
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: The model ``kvplugin bench --quality`` uses.
SPEC = ModelSpec()
#: A seconds-long build for tests (barely trained; enough to order the bit widths).
QUICK_SPEC = replace(SPEC, num_heads=1, seq_len=96, batch_size=4, steps=25, warmup=5)
#: The trained hybrid ``kvplugin bench --quality --hybrid`` measures the state codec on
HYBRID_SPEC = replace(SPEC, model_type="qwen3_next")
QUICK_HYBRID_SPEC = replace(QUICK_SPEC, model_type="qwen3_next")


# --------------------------------------------------------------------------- data


def _corpus() -> str:
    from kvplugin.tools.models.corpus import CORPUS

    return CORPUS


def _corpus_hash() -> str:
    return hashlib.sha256(_corpus().encode()).hexdigest()[:16]


def _paragraphs() -> list[str]:
    paras = [" ".join(p.split()) for p in _corpus().split("\n\n") if p.strip()]
    return [p for p in paras if p]


def _split() -> tuple[str, str]:
    """(training prose, held-out prose): the last two paragraphs are never trained on."""
    paras = _paragraphs()
    n_held = 2 if len(paras) > 4 else 1
    return "\n".join(paras[:-n_held]) + "\n", "\n".join(paras[-n_held:]) + "\n"


_TOKEN_RE = re.compile(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]|\n")
UNK = 0


def _split_tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Word-level vocabulary of the shipped corpus (id 0 is ``<unk>``), sorted: deterministic,
    no tokenizer library involved. One token per word makes every training step carry far
    more text than bytes would, which matters on a slow CPU."""
    return ("<unk>", *sorted(set(_split_tokens(_corpus()))))


@functools.lru_cache(maxsize=1)
def _ids() -> dict[str, int]:
    return {t: i for i, t in enumerate(vocabulary())}


def _words() -> list[int]:
    """Ids of the alphabetic words (the material of copy documents)."""
    return [i for i, t in enumerate(vocabulary()) if t.isalpha()]


def encode(text: str) -> list[int]:
    ids = _ids()
    return [ids.get(t, UNK) for t in _split_tokens(text)]


def decode(ids: list[int]) -> str:
    vocab = vocabulary()
    out = ""
    for i in ids:
        t = vocab[i] if 0 <= i < len(vocab) else "<unk>"
        out += t if (not out or t in ".,;:!?)'\n" or out.endswith(("\n", "(")))  else " " + t
    return out


def copy_unit_range(spec: "ModelSpec") -> tuple[int, int]:
    """Tokens in the repeated unit of copy documents: long enough that copying must look far
    back, short enough that a training sequence holds at least two copies."""
    return max(4, spec.seq_len // 8), max(5, spec.seq_len // 2 - 1)


def copy_document(rng: Any, length: int, unit: tuple[int, int],
                  words: list[int] | None = None) -> list[int]:
    """Random corpus words (``unit`` tokens, inclusive range) + ".", repeated to ``length``."""
    words = words or _words()
    n = int(rng.integers(unit[0], unit[1] + 1))
    piece = [words[int(j)] for j in rng.integers(0, len(words), n)] + [_ids()["."]]
    out: list[int] = []
    while len(out) < length:
        out += piece
    return out[:length]


def _prose(rng: Any, ids: list[int], length: int) -> list[int]:
    if len(ids) <= length:
        return (ids * (length // max(len(ids), 1) + 1))[:length]
    start = int(rng.integers(0, len(ids) - length))
    return ids[start:start + length]


# Story paragraphs: a small template grammar over corpus words. Each paragraph fixes a cast
# (two people, a place, a thing, adjectives, a number, a time) and its sentences mostly reuse
# it, so predicting a later sentence means retrieving entities from earlier in the context
# through attention, which is what a reused prompt entry is for. Unlimited, seeded, never
# memorised, and held-out paragraphs come from another seed.
_CAST = {
    "S": "postman librarian conductor dog passengers parents readers gulls people boats".split(),
    "P": ("bakery library station market bridge church harbour garden hospital school square "
          "forest valley street room town").split(),
    "O": ("bread coffee cheese honey apples pears potatoes onions carrots tomatoes beans lettuce "
          "soup cake book books tickets shoes knives baskets letter coins fish seeds jars "
          "newspapers").split(),
    "A": ("dark warm wet small large old new green fresh simple soft thin tall hot silver wooden "
          "long short full careful tired bored early slow").split(),
    "N": "two three four five six seven eight twelve twenty thirty forty".split(),
    "T": "morning afternoon evening night noon dawn".split(),
}
_TEMPLATES = [
    "In the {T} the {S} walked to the {P} .",
    "The {S} received {N} {O} at the {P} .",
    "The {O} was {A} and the {P} was {B} .",
    "Then the {S} gave the {O} to the {R} .",
    "At {T} the {R} said that the {O} was {A} .",
    "The {S} kept the {O} in the {P} until the {T} .",
    "Each {T} the {S} comes back to the {P} for more {O} .",
    "The {R} knew the {O} from the {P} , but the {S} knows the {Q} .",
    "There were {N} {A} {O} on the tables of the {P} .",
    "The {S} and the {R} count the {O} again .",
]


_ALIAS = {"R": "S", "B": "A", "Q": "O"}


def story_paragraph(rng: Any) -> list[int]:
    """One paragraph of 4-8 template sentences over a fixed cast (see above)."""
    def pick(cat: str) -> str:
        words = _CAST[cat]
        return words[int(rng.integers(len(words)))]

    cast = {k: pick(k) for k in ("S", "P", "O", "A", "N", "T")}
    cast["R"] = pick("S")
    cast["B"] = pick("A")
    cast["Q"] = pick("O")
    text = []
    for _ in range(int(rng.integers(4, 9))):
        t = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        slots = {k: (v if rng.random() < 0.85 else pick(_ALIAS.get(k, k)))
                 for k, v in cast.items()}
        text.append(t.format(**slots))
    ids = _ids()
    return [ids.get(w, UNK) for w in " ".join(text).split()] + [ids["\n"]]


def _stories(rng: Any, length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += story_paragraph(rng)
    start = int(rng.integers(0, max(1, len(out) - length)))
    return out[start:start + length]


def train_documents(spec: ModelSpec, rng: Any) -> Iterator[list[int]]:
    """Endless training sequences of ``seq_len + 1`` token ids: stories, corpus prose and
    copy documents in the spec's proportions."""
    prose = encode(_split()[0])
    words = _words()
    unit = copy_unit_range(spec)
    n = spec.seq_len + 1
    while True:
        u = rng.random()
        if u < spec.copy_fraction:
            yield copy_document(rng, n, unit, words)
        elif u < spec.copy_fraction + spec.prose_fraction:
            yield _prose(rng, prose, n)
        else:
            yield _stories(rng, n)


def heldout_documents(length: int, n_story: int, *, spec: "ModelSpec | None" = None,
                      n_copy: int = 0, seed: int = 12345) -> list[tuple[str, list[int]]]:
    """Held-out evaluation documents of ``length`` tokens, from seeds never used in training:
    ``n_story`` story documents, ``n_copy`` copy documents and one of held-out corpus prose."""
    import numpy as np

    spec = spec or SPEC
    rng = np.random.default_rng([seed, 7])
    unit = copy_unit_range(spec)
    docs = [("story", _stories(rng, length)) for _ in range(n_story)]
    docs += [("copy", copy_document(rng, length, unit, _words())) for _ in range(n_copy)]
    docs.append(("prose", _prose(rng, encode(_split()[1]), length)))
    return docs


# --------------------------------------------------------------------------- model


def default_model_dir(spec: ModelSpec = SPEC) -> Path:
    """``$KVPLUGIN_HOME/quality-model-v<N>`` or ``$XDG_CACHE_HOME/kvplugin/...``
    (``~/.cache/kvplugin/quality-model-v<N>``); a non-default spec gets its fingerprint."""
    name = f"quality-model-v{spec.version}"
    if spec != SPEC:
        name += f"-{spec.fingerprint()}"
    return kvplugin_home() / name


def _new_model(spec: ModelSpec):
    arch = __import__(f"mlx_lm.models.{spec.model_type}", fromlist=["Model"])
    return arch.Model(arch.ModelArgs.from_dict(spec.model_config()))


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_built(directory: Path, spec: ModelSpec = SPEC) -> bool:
    marker = _read_marker(Path(directory))
    return (
        isinstance(marker, dict)
        and marker.get("fingerprint") == spec.fingerprint()
        and (Path(directory) / _WEIGHTS).is_file()
        and (Path(directory) / _WEIGHTS).stat().st_size == marker.get("weights_bytes")
    )


def _eval_loss(model, docs: list[list[int]]) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.array(docs)
    logits = model(x[:, :-1]).astype(mx.float32)
    return float(nn.losses.cross_entropy(logits, x[:, 1:]).mean().item())


def train(spec: ModelSpec, progress: Callable[[int, float], None] | None = None):
    """Train a model from scratch; returns ``(model, info)`` (fp32 weights)."""
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    mx.random.seed(spec.seed)
    rng = np.random.default_rng([spec.seed, 1])
    model = _new_model(spec)
    mx.eval(model.parameters())
    schedule = optim.join_schedules(
        [optim.linear_schedule(spec.lr / 20, spec.lr, spec.warmup),
         optim.cosine_decay(spec.lr, max(spec.steps - spec.warmup, 1), spec.lr / 20)],
        [spec.warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=spec.weight_decay)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y).mean()

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = grad_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    docs = train_documents(spec, rng)
    losses: list[float] = []
    t0 = time.perf_counter()
    for i in range(spec.steps):
        batch = mx.array([next(docs) for _ in range(spec.batch_size)])
        loss = step(batch[:, :-1], batch[:, 1:])
        mx.eval(state, loss)
        losses.append(float(loss.item()))
        if progress is not None:
            progress(i + 1, losses[-1])
    seconds = time.perf_counter() - t0
    held = heldout_documents(spec.seq_len + 1, 4, spec=spec)
    info = {
        "train_seconds": seconds,
        "train_tokens": spec.steps * spec.batch_size * spec.seq_len,
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-max(1, spec.steps // 20):])),
        "heldout_loss": {kind: _eval_loss(model, [ids for k, ids in held if k == kind])
                         for kind in ("story", "prose")},
    }
    return model, info


def build_quality_model(directory: Path | None = None, *, spec: ModelSpec = SPEC,
                        force: bool = False,
                        progress: Callable[[int, float], None] | None = None) -> Path:
    """Train (once) and save the quality model in ``directory``; reuse a matching build."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    directory = Path(directory or default_model_dir(spec)).expanduser().resolve()
    if not force and is_built(directory, spec):
        return directory
    with build_lock(directory):
        if not force and is_built(directory, spec):
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        (directory / _MARKER).unlink(missing_ok=True)
        model, info = train(spec, progress)
        weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
        tmp = directory / (_WEIGHTS + ".tmp.safetensors")
        mx.save_safetensors(str(tmp), weights)
        os.replace(tmp, directory / _WEIGHTS)
        (directory / "config.json").write_text(json.dumps(spec.model_config(), indent=2) + "\n")
        marker = {
            "fingerprint": spec.fingerprint(),
            "spec": asdict(spec),
            "weights_bytes": (directory / _WEIGHTS).stat().st_size,
            "parameters": int(sum(v.size for v in weights.values())),
            "mlx": _mlx_version(),
            **info,
        }
        tmp = directory / (_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / _MARKER)
    return directory


def _mlx_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("mlx")
    except Exception:  # pragma: no cover
        return None


def load_quality_model(directory: Path, spec: ModelSpec = SPEC):
    """``(model, marker)``: the fp16 model (eval mode) and its build record."""
    import mlx.core as mx

    directory = Path(directory)
    model = _new_model(spec)
    model.load_weights(str(directory / _WEIGHTS), strict=True)
    model.set_dtype(mx.float16)
    model.eval()
    mx.eval(model.parameters())
    return model, _read_marker(directory) or {}


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplugin.tools.models.quality",
                                description="Train the tiny quality-bench model (offline).")
    p.add_argument("directory", nargs="?", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="the seconds-long test model")
    p.add_argument("--force", action="store_true", help="retrain even if built")
    p.add_argument("--hybrid", action="store_true", help="the hybrid model (state codec)")
    args = p.parse_args(argv)
    spec = [[SPEC, QUICK_SPEC], [HYBRID_SPEC, QUICK_HYBRID_SPEC]][args.hybrid][args.quick]
    last = [time.perf_counter()]

    def progress(i: int, loss: float) -> None:
        if i == spec.steps or time.perf_counter() - last[0] > 5:
            last[0] = time.perf_counter()
            print(f"step {i}/{spec.steps} loss {loss:.3f}", file=sys.stderr)

    path = build_quality_model(args.directory, spec=spec, force=args.force, progress=progress)
    print(json.dumps(_read_marker(path), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
