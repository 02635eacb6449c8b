"""A Hugging Face model's chat template: the Jinja text in its folder that lays a conversation out in the
tokens the model was tuned on (Qwen3's ChatML ``<|im_start|>user ... <|im_end|>``, for instance), so that
the server's /v1/chat/completions talks to such a model in its own format.

The template is rendered in Jinja's sandbox, with what transformers gives it (the messages,
``add_generation_prompt``, the special tokens the folder names, ``raise_exception``, ``strftime_now``, a
``tojson`` filter), and encoded as transformers encodes it. What a user wrote never becomes a special
token: a message that contains one (say "<|im_end|>", which would end its turn and let it write the
next) is refused with its name.
"""

import datetime
import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmscratch.files import read_json_object

__all__ = ["ChatTemplate"]

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass
class ChatTemplate:
    """source: the Jinja text. tokens: the special tokens it may use by name (bos_token, eos_token, ...).
    stops: the texts that end the model's answer (the folder's eos_token, and the tokens its
    generation_config.json ends on: Gemma's "<end_of_turn>")."""

    source: str
    tokens: dict[str, str] = field(default_factory=dict)
    stops: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, folder: str | os.PathLike, tokenizer=None) -> "ChatTemplate | None":
        """The template of a Hugging Face folder (chat_template.jinja, else tokenizer_config.json's
        "chat_template"), or None if it has none; a malformed file is a ValueError naming it. With the
        folder's tokenizer, the ids generation_config.json ends on are stops too."""
        folder = Path(folder)
        config_file = folder / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # where transformers 4.50 and later save it
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(source, list):  # several named templates: the default one
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{config_file}: chat_template should be Jinja text, got {type(source).__name__}")
        tokens = {key: _token_text(config[key]) for key in SPECIAL_KEYS if config.get(key) is not None}
        stops = [tokens["eos_token"]] if "eos_token" in tokens else []
        generation_file = folder / "generation_config.json"
        if tokenizer is not None and generation_file.is_file():
            ends = read_json_object(generation_file).get("eos_token_id")
            for token_id in ends if isinstance(ends, list) else [] if ends is None else [ends]:
                if isinstance(token_id, int) and 0 <= token_id < tokenizer.vocab_size:
                    stops.append(tokenizer.decode([token_id]))
        template = cls(source, tokens, tuple(dict.fromkeys(stop for stop in stops if stop)))
        template._compiled  # a template that does not parse is named now, not at the first request
        return template

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it (text, special tokens written out)."""
        from jinja2 import TemplateError

        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.tokens)
        except TemplateError as err:
            raise ValueError(f"the chat template failed on this conversation: {err}") from None

    def encode(self, messages: Sequence[dict], tokenizer, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``render``, its special tokens as such; a message whose content holds one of the
        tokenizer's special tokens is a ValueError naming it (it could end its turn and forge another)."""
        for index, message in enumerate(messages):
            content = message.get("content")
            found = [token for token in tokenizer.special_tokens
                     if token not in getattr(tokenizer, "added_text", ()) and isinstance(content, str)
                     and token in content]
            if found:
                first = min(found, key=content.index)
                raise ValueError(f"message {index} contains the special token {first!r}, which only the chat "
                                 "template may write")
        return tokenizer.encode(self.render(messages, add_generation_prompt), allowed_special="all")

    @functools.cached_property
    def _compiled(self):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError("a chat template needs jinja2: pip install jinja2") from None

        def raise_exception(message):
            raise ValueError(f"the chat template refused the conversation: {message}")

        def tojson(value, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols", _generation_block()])
        environment.filters["tojson"] = tojson
        environment.globals.update(raise_exception=raise_exception,
                                   strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        try:
            return environment.from_string(self.source)
        except TemplateError as err:
            raise ValueError(f"the chat template is not valid Jinja: {err}") from None


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: the text, or an object with its "content"."""
    return value["content"] if isinstance(value, dict) else str(value)


def _generation_block():
    """A Jinja extension for ``{% generation %}...{% endgeneration %}``, which transformers' templates use to
    mark the assistant's part for training masks: here it renders what it holds, as transformers does."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation
