"""Tokenizers behind one protocol (`Tokenizer`): the byte tokenizer of the synthetic debug flavors, and a pretrained
LLM's own (`HFTokenizer`: its tokenizer.json and tokenizer_config.json, read offline). `tokenizer_for(recipe)`
is the recipe's: the LLM's when `model.pretrained.llm` names one, else the byte tokenizer.

Placeholder tokens (one per image patch, audio embedding or video embedding once the data layer expands them)
are where encoder outputs land; a pretrained vocabulary that lacks them gets them added as special tokens past
its base vocabulary (`added_tokens`), so the model grows its embeddings by that many rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from omni_core.recipe.schema import Recipe

NUM_BYTES = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_ID = 259  # one per image embedding position
AUDIO_ID = 260  # one per audio embedding position
VIDEO_ID = 261  # one per video embedding position (frames merged in time and space)
VOCAB_SIZE = 264  # rounded up to a multiple of 8, above every special id

PLACEHOLDER_IDS = {"image": IMAGE_ID, "audio": AUDIO_ID, "video": VIDEO_ID}
# The placeholder strings a pretrained tokenizer gets by default (LLaVA's is `<image>`); a model family with its
# own (Qwen2-Audio's `<|AUDIO|>`) names it in the recipe's model.placeholders.
PLACEHOLDER_TOKENS = {"image": "<image>", "audio": "<audio>", "video": "<video>"}
# The named special tokens a chat template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer(Protocol):
    """What the data layer, the batch layout and the chat renderer ask of a tokenizer."""

    @property
    def name(self) -> str:
        """Where it came from, for messages."""

    @property
    def vocab_size(self) -> int:
        """Ids it can produce, added tokens included: the embedding rows the model needs at least."""

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None:
        """None where the model family starts documents without one (Qwen2)."""

    @property
    def eos_id(self) -> int: ...

    @property
    def placeholder_ids(self) -> Mapping[str, int]:
        """Per modality ("image", "audio", "video"), the id its placeholders carry."""

    @property
    def chat_template(self) -> str | None: ...

    @property
    def template_tokens(self) -> Mapping[str, str]:
        """The named special tokens (bos_token, eos_token, ...) as the chat template sees them."""

    @property
    def added_tokens(self) -> tuple[str, ...]:
        """Tokens omni added past the pretrained vocabulary (placeholders it lacked), in id order."""

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added (special tokens written in the text are recognised)."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`, and each token's (start, end) character span in `text`."""

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """len(encode(text)) of each text, batched."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


def never_predicted(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids that are never a training target: placeholders (encoder outputs sit there), BOS and padding, except
    where one is also EOS (GPT-2's BOS, a vocabulary that pads with EOS): EOS stays a target, and padding
    documents get no targets at all."""
    ids = {*tokenizer.placeholder_ids.values(), tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        ids.add(tokenizer.bos_id)
    return frozenset(ids - {tokenizer.eos_id})


_BYTE_SPECIALS = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"} | {
    token: PLACEHOLDER_TOKENS[kind] for kind, token in PLACEHOLDER_IDS.items()
}


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255 and the special ids above them: needs no file, round-trips any text. It has no
    chat template (conversations need a pretrained LLM's tokenizer)."""

    name = "the byte tokenizer"
    vocab_size = VOCAB_SIZE
    pad_id = PAD_ID
    bos_id: int | None = BOS_ID
    eos_id = EOS_ID
    placeholder_ids: Mapping[str, int] = PLACEHOLDER_IDS
    chat_template: str | None = None
    template_tokens: Mapping[str, str] = {}
    added_tokens: tuple[str, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for at, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(at, at + 1)] * len(encoded))
        return ids, offsets

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Bytes of each text, without encoding ASCII text."""
        return [len(text) if text.isascii() else len(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if i < NUM_BYTES:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(_BYTE_SPECIALS.get(i, f"<{i}>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


BYTE_TOKENIZER = ByteTokenizer()


class PlaceholderError(ValueError):
    """Media placeholder tokens that cannot be used (model.placeholders): an unknown medium, or one token for two
    roles."""


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A pretrained LLM's fast tokenizer (`tokenizers`), with its special tokens and chat template as
    tokenizer_config.json (or chat_template.jinja beside it) gives them.

    A vocabulary without a pad token pads with EOS, as most SFT stacks do: padding sits in documents of its own
    that carry no targets, so EOS keeps being learned where a document ends."""

    backend: Any = field(repr=False)  # tokenizers.Tokenizer
    name: str
    pad_id: int
    bos_id: int | None
    eos_id: int
    placeholder_ids: Mapping[str, int]
    chat_template: str | None
    template_tokens: Mapping[str, str]
    added_tokens: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_pretrained(cls, folder: str | Path, placeholders: Mapping[str, str] | None = None) -> HFTokenizer:
        """The tokenizer of the checkpoint `folder`, offline; `placeholders` overrides PLACEHOLDER_TOKENS per
        modality. Raises FileNotFoundError / ValueError naming the file and field that is missing or malformed."""
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        tokenizer_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: missing (the LLM's fast tokenizer, as transformers saves it)")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as err:  # tokenizers raises its Rust errors as plain Exception
            raise ValueError(f"{tokenizer_file}: not a tokenizers file: {err}") from None
        config = _json_object(config_file)
        _add_declared_tokens(backend, config, config_file)
        tokens = {key: _token_field(config, key, config_file) for key in TEMPLATE_TOKENS}
        ids = {key: _token_id(backend, key, content, config_file) for key, content in tokens.items() if content}
        if "eos_token" not in ids:
            raise ValueError(f"{config_file}: eos_token is missing (documents and assistant turns end with it)")
        wanted = PLACEHOLDER_TOKENS | dict(placeholders or {})
        if unknown := sorted(set(wanted) - set(PLACEHOLDER_TOKENS)):
            raise PlaceholderError(f"placeholder tokens for {unknown}: only {sorted(PLACEHOLDER_TOKENS)} have encoders")
        named = set(tokens.values())
        if len(set(wanted.values())) < len(wanted) or named & set(wanted.values()):
            raise PlaceholderError(
                f"placeholder tokens {wanted} must differ from each other and from the named special tokens "
                "(an encoder's rows would land on another's, or on text)"
            )
        added = [token for token in wanted.values() if backend.token_to_id(token) is None]
        if added:
            from tokenizers import AddedToken

            backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added])
        return cls(
            backend=backend,
            name=str(folder),
            pad_id=ids.get("pad_token", ids["eos_token"]),
            bos_id=ids.get("bos_token"),
            eos_id=ids["eos_token"],
            placeholder_ids={kind: _token_id(backend, kind, token, tokenizer_file) for kind, token in wanted.items()},
            chat_template=_chat_template(folder, config, config_file),
            template_tokens={key: content for key, content in tokens.items() if content},
            added_tokens=tuple(added),
        )

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self.backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]

    def lengths(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(encoding.ids) for encoding in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the tokenizer's special tokens and chat template)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a JSON object")
    return obj


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _token_field(config: dict[str, Any], key: str, path: Path) -> str | None:
    value = config.get(key)
    if value is None:
        return None
    content = _token_content(value)
    if not content:
        raise ValueError(
            f"{path}: {key} must be a token string or an AddedToken object with a non-empty string 'content' "
            f"(got {value!r})"
        )
    return content


def _token_id(backend: Any, key: str, content: str, path: Path) -> int:
    token_id = backend.token_to_id(content)
    if token_id is None:
        raise ValueError(f"{path}: {key} {content!r} is not a token of tokenizer.json's vocabulary")
    return int(token_id)


def _add_declared_tokens(backend: Any, config: dict[str, Any], path: Path) -> None:
    """The tokens tokenizer_config.json's added_tokens_decoder declares: one tokenizer.json lacks is added at
    its declared id (as transformers does), one it has must sit at that id."""
    from tokenizers import AddedToken

    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError(f"{path}: added_tokens_decoder must be an object of id -> AddedToken")
    entries = []
    for key, value in declared.items():
        content = _token_content(value)
        if not key.isdigit() or content is None:
            raise ValueError(
                f"{path}: added_tokens_decoder[{key!r}] must map an integer id to an AddedToken object with a "
                f"string 'content' (got {value!r})"
            )
        entries.append((int(key), content, value if isinstance(value, dict) else {}))
    for token_id, content, options in sorted(entries):
        have = backend.token_to_id(content)
        if have is None and token_id == backend.get_vocab_size(with_added_tokens=True):
            flags = {k: bool(options[k]) for k in ("lstrip", "rstrip", "single_word", "normalized") if k in options}
            backend.add_tokens([AddedToken(content, special=bool(options.get("special", False)), **flags)])
        elif have != token_id:
            raise ValueError(
                f"{path}: added_tokens_decoder[{token_id}] is {content!r}, but tokenizer.json "
                + ("lacks it and has other tokens up to that id" if have is None else f"gives it id {have}")
            )


def _chat_template(folder: Path, config: dict[str, Any], path: Path) -> str | None:
    """The default chat template: chat_template.jinja beside the config (transformers 4.4x+ writes it there, and
    it wins over the config's), else the config's string, or its list's entry named "default"."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
        for entry in value
    ):
        named = {entry["name"]: entry["template"] for entry in value}
        if "default" not in named:
            raise ValueError(f"{path}: chat_template lists {sorted(named)} but none named 'default'")
        return str(named["default"])
    raise ValueError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


def tokenizer_for(recipe: Recipe) -> Tokenizer:
    """The recipe's tokenizer: the pretrained LLM's when model.pretrained.llm names its folder (with the
    model.placeholders tokens for media), else the byte tokenizer of the synthetic debug flavors."""
    folder = recipe.model.pretrained.llm
    placeholders = {str(kind): token for kind, token in recipe.model.placeholders.items()}
    return BYTE_TOKENIZER if folder is None else HFTokenizer.from_pretrained(folder, placeholders)
