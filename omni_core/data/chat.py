"""Conversations rendered with the tokenizer's own chat template, as transformers' `apply_chat_template` renders
them (same jinja2 sandbox, options, globals and special-token variables, so the same token ids), with a mask of
the tokens a model is trained on.

Messages are OpenAI-style: {"role": "system" | "user" | "assistant", "content": str | [part, ...]}, a part being
{"type": "text", "text": ...} or {"type": "image" | "audio" | "video"}. The template writes each media part as
the tokenizer's placeholder token (once per part; the data layer repeats it for every embedding the encoder
makes). The trained tokens are the assistant replies: each reply's text and the end-of-turn tokens the template
writes after it, located by rendering the conversation's prefixes (up to the reply with the generation prompt:
where it starts; up to and including it: where it ends) and mapping those character spans onto the tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from omni_core.common.tokenizer import Tokenizer

Message = Mapping[str, Any]


@dataclass(frozen=True)
class RenderedConversation:
    text: str  # what the template wrote
    ids: list[int]
    trainable: list[bool]  # per token: part of an assistant reply (or of anything, with train_on_prompt)


def render_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    train_on_prompt: bool = False,
    add_generation_prompt: bool = False,
) -> RenderedConversation:
    """The conversation as the tokenizer's chat template writes it, tokenised once, with its trainable tokens.
    Raises ValueError when the tokenizer has no template, or the template's output cannot be split into turns
    or does not write each media part as its placeholder token."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    chat = [_aliased({key: value for key, value in message.items() if value is not None}) for message in messages]
    render = _renderer(tokenizer)
    text = render(chat, add_generation_prompt)
    ids, offsets = tokenizer.encode_with_offsets(text)
    _check_placeholders(tokenizer, chat, ids)
    if train_on_prompt:
        return RenderedConversation(text, ids, [True] * len(ids))
    replies = [i for i, message in enumerate(chat) if message.get("role") == "assistant"]
    spans = [_reply_span(render, chat, i, text, tokenizer.name) for i in replies]
    return RenderedConversation(text, ids, _overlapping(offsets, spans))


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _renderer(tokenizer: Tokenizer) -> Callable[[list[dict[str, Any]], bool], str]:
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{tokenizer.name}: no chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja "
            "beside it): conversations are rendered with the LLM's own template"
        )
    template = _compiled(tokenizer.chat_template)
    variables = dict(tokenizer.template_tokens)

    def render(chat: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return str(
                template.render(
                    messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
                )
            )
        except jinja2.TemplateError as err:
            raise ValueError(f"{tokenizer.name}: the chat template failed on {len(chat)} messages: {err}") from None

    return render


def _reply_span(
    render: Callable[[list[dict[str, Any]], bool], str], chat: list[dict[str, Any]], i: int, text: str, name: str
) -> tuple[int, int]:
    """Character span of assistant reply i in `text`: from the end of the prompt that asks for it to the end of
    the conversation up to and including it."""
    prompt, upto = render(chat[:i], True), render(chat[: i + 1], False)
    if not (text.startswith(prompt) and text.startswith(upto) and len(prompt) <= len(upto)):
        raise ValueError(
            f"{name}: the chat template writes the conversation up to message {i} differently from the start of the "
            "whole conversation, so its assistant reply cannot be located (a template that rewrites earlier turns)"
        )
    return len(prompt), len(upto)


def _overlapping(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token, whether its characters overlap a span (transformers' rule for its assistant mask): spans and
    offsets are both in order, so one pass."""
    mask, at = [], 0
    for start, end in offsets:
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        mask.append(at < len(spans) and end > spans[at][0])
    return mask


def _check_placeholders(tokenizer: Tokenizer, chat: list[dict[str, Any]], ids: list[int]) -> None:
    """Each media part must come out as exactly one placeholder token: the data layer puts the encoder's
    embeddings there, one run per part."""
    parts: Counter[Any] = Counter(
        part.get("type")
        for message in chat
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, Mapping)
    )
    written = Counter(ids)
    for kind, token in tokenizer.placeholder_ids.items():
        if parts[kind] != written[token]:
            raise ValueError(
                f"{tokenizer.name}: the conversation has {parts[kind]} {kind} parts, but the chat template and "
                f"its text give {written[token]} {kind} placeholder tokens (id {token}): the template must write each "
                f"{kind} part as the placeholder, and the text must not contain it"
            )


class _TemplateDict:
    """`dict` as templates may call it, without exposing the class (transformers' TemplateDict)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in transformers' environment: an immutable sandbox with trim_blocks and
    lstrip_blocks, loop controls, the `generation` tag (rendered as its body), and the globals and `tojson`
    filter templates rely on."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' own mask; the
        prefixes locate it here, so the tag renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 reads it from the class)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    return env.from_string(source)
