"""A model of Qwen2.5-0.5B-Instruct's exact shape, built locally with random weights, for ``benchmarks/scale.py``:
the Qwen2 architecture at 24 layers, hidden size 896, MLP size 4,864, 14 attention heads sharing 2 key/value
heads, a 151,936-token vocabulary whose table is also the output layer, rope theta 10⁶. ``--smoke`` builds the same
shape family at 2 layers and a 4,096-token vocabulary.

    python benchmarks/scale_model.py           # builds (once) and prints the folder
    python benchmarks/scale_model.py --smoke

The tokenizer is a byte-level BPE trained with ``tokenizers`` on text the project holds (``docs/*.md``, the
README, the task modules under ``unipg/tasks``). That text yields a few thousand merges, not 151k, so the
vocabulary is filled up to its size with reserved tokens ``<|reserved_N|>``: entries of the BPE vocabulary that
no merge produces, so they never come out of encoding but are decoded like any token (a random model samples
them). Qwen2.5's control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and tool-call tokens
(``<tool_call>``, ``</tool_call>``) take the last ids, as in Qwen's own tokenizer, with the bundled Qwen2.5 chat
template (``unipg.policy.templates``). The model's context is 8,192 positions instead of Qwen's 32,768: rotary
positions carry no weights, so every parameter keeps Qwen's shape, and vLLM's KV cache must hold one whole context
(the 0.25 GiB the GPU-path checks give it holds ~10k tokens of this shape).

Both are saved with ``save_pretrained`` under the unipg cache (``UNIPG_CACHE``, as the embedded model) in a folder
marked complete last, so unipg loads it by path like a hub model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from unipg.policy.embedded import cache_dir  # noqa: E402
from unipg.policy.templates import FAMILIES, read_template  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

# Bump when the tokenizer, the shape or the initialisation changes: it is part of the folder's name.
BUILDER_VERSION = 1
MARKER_FILE = "unipg-scale-model.json"  # written last: its presence marks a folder complete
CONTEXT_POSITIONS = 8192
QWEN = FAMILIES["qwen2.5"]
RESERVED = "<|reserved_{}|>"
CORPUS_GLOBS = ("docs/*.md", "README.md", "unipg/tasks/**/*.py")


@dataclass(frozen=True)
class Shape:
    """The Qwen2 dimensions of one scale model."""

    layers: int
    vocabulary: int  # tokens of the tokenizer, and rows of the embedding table
    hidden: int = 896
    intermediate: int = 4864
    heads: int = 14
    key_value_heads: int = 2
    rope_theta: float = 1e6


QWEN_0_5B = Shape(layers=24, vocabulary=151_936)
SMOKE = Shape(layers=2, vocabulary=4096)


def corpus() -> list[str]:
    """The project's own text, one string per file, in a fixed order."""
    paths = sorted({path for pattern in CORPUS_GLOBS for path in ROOT.glob(pattern)})
    return [path.read_text(encoding="utf-8") for path in paths]


def build_tokenizer(vocabulary: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly ``vocabulary`` tokens: merges learned from ``corpus()``, reserved tokens up to
    the size, Qwen2.5's control and tool-call tokens last, and Qwen2.5's chat template."""
    from transformers import PreTrainedTokenizerFast  # after unipg, which hides torch companions it cannot import

    controls = (*QWEN.special_tokens, *QWEN.added_tokens)
    learned = vocabulary - len(controls)
    trainer = trainers.BpeTrainer(
        vocab_size=learned, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(corpus(), trainer)
    trained = json.loads(backend.to_str())["model"]
    vocab = dict(trained["vocab"])
    for index in range(learned - len(vocab)):
        vocab[RESERVED.format(index)] = len(vocab)
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in trained["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN.special_tokens])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN.added_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=QWEN.eos_token,
        pad_token=QWEN.pad_token,
        model_max_length=CONTEXT_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = read_template("qwen2.5")
    if len(tokenizer) != vocabulary:
        raise RuntimeError(f"built a tokenizer of {len(tokenizer)} tokens, not {vocabulary}")
    return tokenizer


def build_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM of ``shape``, seeded inside a forked RNG state."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocabulary,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.key_value_heads,
        max_position_embeddings=CONTEXT_POSITIONS,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype=torch.bfloat16,  # as Qwen ships its weights; unipg loads them in model.dtype
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(torch.bfloat16).eval()


def scale_model_path(shape: Shape) -> Path:
    """The folder of ``shape``'s model and tokenizer under the unipg cache, built on first use (into a temporary
    sibling renamed into place, so a reader sees no folder or a complete one)."""
    name = f"scale-qwen2-v{BUILDER_VERSION}-{shape.layers}l-{shape.vocabulary}v"
    target = cache_dir() / name
    if (target / MARKER_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        tokenizer = build_tokenizer(shape.vocabulary)
        build_model(shape, tokenizer).save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER_FILE).write_text(json.dumps({"builder_version": BUILDER_VERSION, **vars(shape)}) + "\n")
        shutil.rmtree(target, ignore_errors=True)  # an incomplete folder left by an interrupted build
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2 layers, a 4,096-token vocabulary")
    args = parser.parse_args()
    print(f"scale model: {scale_model_path(SMOKE if args.smoke else QWEN_0_5B)}")


if __name__ == "__main__":
    main()
