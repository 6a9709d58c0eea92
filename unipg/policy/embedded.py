"""The embedded default model: a small Qwen2 causal LM and a character-level tokenizer, built locally.

Everything in the project must run on a laptop CPU with no downloads, so instead of fetching a hub model the
project builds its own: a standard Hugging Face architecture (Qwen2) at a few million parameters or less, and
a tokenizer with one token per character. Both are saved with `save_pretrained` into a cache folder and every
later user loads them back by path, with `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)`, exactly as it would load a hub model. Nothing downstream knows the
model is special; configs name it `"embedded"` (or `"embedded:<size>"`) and `resolve_model_name` turns that
name into the folder.

The weights are randomly initialised: the model knows nothing until it is trained (supervised warm start,
then RL). A character-level vocabulary keeps the embedding table tiny and makes every digit its own token,
which is what arithmetic tasks want.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Bump whenever the tokenizer, the architecture or the initialisation changes: the version is part of the
# cache folder's name, so a changed builder never loads a model built by an older one.
BUILDER_VERSION = 3

# Written last into a built folder; its presence is what marks the folder complete.
MARKER_FILE = "unipg-embedded.json"

PAD_TOKEN = "<pad>"
END_TOKEN = "<|end|>"  # ends every chat turn and serves as EOS
UNKNOWN_TOKEN = "<unk>"
ROLES = ("system", "user", "assistant", "tool")
# Order fixes the ids: <pad> is 0 and <|end|> is 1, then one marker per chat role, then <unk>.
SPECIAL_TOKENS = (PAD_TOKEN, END_TOKEN, *(f"<|{role}|>" for role in ROLES), UNKNOWN_TOKEN)
CHARACTERS = tuple(chr(code) for code in range(32, 127)) + ("\n",)  # printable ASCII and newline

# Each message is `<|role|>content<|end|>`; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MAX_POSITIONS = 512
CHARACTER_TOKENIZER_FLAG = "unipg_character_tokenizer"

_TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
EMBEDDED_SIZES: dict[str, dict] = {
    # ≈1.0M parameters: the default, fast enough to train on two CPU cores.
    "tiny": _TINY,
    # ≈5.9M parameters: for tasks the tiny model cannot fit.
    "small": dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024
    ),
    # The tiny model with numbers read in groups of up to three digits and a key/value head per attention head
    # (≈1.2M parameters, the extra ones in the embedding table): an agent copies a number into a call or out of a
    # tool's result in two or three tokens instead of five or six, so the copy no longer depends on the number's
    # length (a character model copies by position and fails the lengths it sees less often). A key/value head per
    # attention head learns the copy in more data orders than shared ones (measured when the model was chosen).
    # Keep "tiny" for arithmetic done in the model's head, which wants one token per digit.
    "tiny-numbers": dict(_TINY, num_key_value_heads=4, tokenizer="numbers"),
}

EMBEDDED_PREFIX = "embedded"


# Every string of two or three digits, for the "numbers" tokenizer (single digits are characters already).
DIGIT_GROUPS = tuple(f"{value:0{width}d}" for width in (2, 3) for value in range(10**width))


def build_tokenizer(numbers: str = "characters") -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per printable ASCII character or newline, plus chat markers;
    with ``numbers="numbers"``, a run of digits is read in groups of up to three from its left (``53336`` →
    ``533`` ``36``), as Llama 3's and GPT-4's tokenizers read numbers.

    The special tokens are registered as added tokens, so `<|user|>` in text is matched whole before the
    per-character split and never broken into characters; `decode(..., skip_special_tokens=True)` drops them.
    Characters outside the vocabulary encode as `<unk>`. There is no BOS token: prompts start with a role.
    """
    if numbers not in ("characters", "numbers"):
        raise ValueError(f"embedded tokenizer: numbers must be 'characters' or 'numbers', got {numbers!r}")
    return character_tokenizer(
        SPECIAL_TOKENS,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        digit_groups=numbers == "numbers",
    )


def character_tokenizer(
    special_tokens: tuple[str, ...],
    *,
    eos_token: str,
    pad_token: str,
    chat_template: str,
    bos_token: str | None = None,
    added_tokens: tuple[str, ...] = (),
    unk_token: str = UNKNOWN_TOKEN,
    digit_groups: bool = False,
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with the given special tokens (ids first, in order) and ``added_tokens``
    (matched whole like special tokens, but kept by ``decode(..., skip_special_tokens=True)``, as Qwen's
    ``<tool_call>`` and ``<think>`` are), then one token per character of ``CHARACTERS``, then (with
    ``digit_groups``) one per group of two or three digits, numbers being split into such groups."""
    specials = tuple(dict.fromkeys((*special_tokens, unk_token)))
    groups = DIGIT_GROUPS if digit_groups else ()
    vocab = {token: index for index, token in enumerate(specials + tuple(added_tokens) + CHARACTERS + groups)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    # `[\s\S]` rather than `.` so that a newline is isolated as its own piece too.
    pieces = r"\d{1,3}|[\s\S]" if digit_groups else r"[\s\S]"
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pieces), behavior="isolated")
    # Fuse joins the pieces back with nothing between them; the default decoder would insert spaces.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad_token,
        eos_token=eos_token,
        bos_token=bos_token,
        unk_token=unk_token,
        model_max_length=MAX_POSITIONS,
        # Clean-up would rewrite " ." as "." and break the exact round trip.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    # Saved into tokenizer_config.json: AutoTokenizer would rebuild a Qwen2 model's tokenizer with Qwen2's
    # byte-level pre-tokenizer (dropping spaces and newlines here); `load_tokenizer` sees this flag and
    # loads tokenizer.json as written.
    tokenizer.init_kwargs[CHARACTER_TOKENIZER_FLAG] = True
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, size: str = "tiny", seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized by `EMBEDDED_SIZES[size]`, in eval mode.

    The initialisation is seeded by `seed` inside a forked RNG state, so building a model neither depends on
    nor disturbs the caller's global random state.
    """
    if size not in EMBEDDED_SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; valid sizes: {sorted(EMBEDDED_SIZES)}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,  # input and output embeddings share one table, as in small Qwen2 models
        rope_theta=10000.0,
        torch_dtype=torch.float32,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{key: value for key, value in EMBEDDED_SIZES[size].items() if key != "tokenizer"},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    if EMBEDDED_SIZES[size].get("tokenizer") == "numbers":
        compose_number_embeddings(model, tokenizer, seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()


def compose_number_embeddings(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """Give every number token's embedding a share of its digits: its own random embedding, plus half a vector
    all numbers share, plus half the (normalised) sum of one vector per (place, digit) (ones, tens, hundreds).

    With independent random embeddings, a thousand number tokens each seen a few times per epoch share nothing,
    so "this is a number" is learned token by token, and an agent that must find "the first number of the
    question" to copy it into a call learns it far later than anything else. Made mostly of shared parts
    (numbers too alike), it finds numbers at once but can no longer match one number against another, which
    copying a multi-token number needs. Half and half gives both (measured when the model was chosen). The input and output embeddings are one table, so the same holds for writing numbers.
    """
    table = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed + 1)
    scale = model.config.initializer_range
    shared = torch.randn(table.shape[1], generator=generator) * scale
    places = torch.randn(3, 10, table.shape[1], generator=generator) * scale
    with torch.no_grad():
        for token, index in tokenizer.get_vocab().items():
            if token.isdigit() and len(token) <= 3:
                digits = [places[place, int(digit)] for place, digit in enumerate(reversed(token))]
                table[index] = 0.5 * shared + 0.5 * sum(digits) / len(digits) ** 0.5 + table[index]


def cache_dir() -> Path:
    """Where built models live: `$UNIPG_CACHE` if set, else `~/.cache/unipg`."""
    configured = os.environ.get("UNIPG_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "unipg"


def embedded_folder_name(size: str, seed: int) -> str:
    return f"embedded-v{BUILDER_VERSION}-{size}-seed{seed}"


def is_complete(folder: Path) -> bool:
    """A folder is a usable build once its marker file exists (the marker is written last)."""
    return (folder / MARKER_FILE).is_file()


def write_embedded(folder: Path, size: str, seed: int) -> None:
    """Build the tokenizer and model and save both into `folder`, marker last."""
    tokenizer = build_tokenizer(EMBEDDED_SIZES[size].get("tokenizer", "characters"))
    model = build_model(tokenizer, size=size, seed=seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    marker = {"builder_version": BUILDER_VERSION, "size": size, "seed": seed}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def build_embedded(target: Path, size: str, seed: int) -> Path:
    """Build into a temporary sibling of `target`, then rename it into place.

    A rename within one filesystem is atomic, so readers only ever see no folder or a complete one. When two
    processes build at once, the second rename fails because the target now exists; that process discards its
    own copy and uses the winner's, which is identical since the build is deterministic.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_embedded(staging, size, seed)
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def embedded_model_path(size: str = "tiny", seed: int = 0, root: str | Path | None = None) -> Path:
    """The folder holding the embedded model and tokenizer, built on first use.

    `root` defaults to `cache_dir()`. Load the result like any hub model:
    `AutoModelForCausalLM.from_pretrained(path)`, `AutoTokenizer.from_pretrained(path)`.
    """
    if size not in EMBEDDED_SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; valid sizes: {sorted(EMBEDDED_SIZES)}")
    target = Path(root).expanduser() if root is not None else cache_dir()
    target = target / embedded_folder_name(size, seed)
    if is_complete(target):
        return target
    if target.exists():
        raise RuntimeError(
            f"{target} exists but has no {MARKER_FILE}, so it is not a complete embedded model; "
            "delete the folder and it will be rebuilt"
        )
    return build_embedded(target, size, seed)


def resolve_model_name(name: str) -> str:
    """Map `"embedded"` or `"embedded:<size>"` to the built folder; pass any other name through unchanged.

    Any other string is a hub id or a local path and is left for `from_pretrained` to interpret.
    """
    if name == EMBEDDED_PREFIX:
        return str(embedded_model_path())
    if name.startswith(EMBEDDED_PREFIX + ":"):
        size = name[len(EMBEDDED_PREFIX) + 1 :]
        if size not in EMBEDDED_SIZES:
            valid = ", ".join(f"'{EMBEDDED_PREFIX}:{known}'" for known in sorted(EMBEDDED_SIZES))
            raise ValueError(f"unknown embedded model {name!r}; valid names: '{EMBEDDED_PREFIX}', {valid}")
        return str(embedded_model_path(size))
    return name
