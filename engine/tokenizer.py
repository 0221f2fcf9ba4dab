"""Text <-> token ids for an HF checkpoint directory, chat templates, and incremental detokenization.

Reads `tokenizer.json` with the HF `tokenizers` package (never `transformers`), the chat template
and special tokens from `tokenizer_config.json` (or `chat_template.jinja`), and the stop ids from
`generation_config.json` / `config.json`. Chat templates render the way transformers renders them
(sandboxed jinja2, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`).

What it does not know: slow (sentencepiece `tokenizer.model`-only) tokenizers, tokenizer classes'
Python-side quirks (e.g. LlamaTokenizer's legacy space handling beyond what tokenizer.json says),
the documents argument of chat templates, stop strings, or anything about models and requests.
Special tokens at encode time come from tokenizer.json's post-processor; `add_bos_token: true` in
tokenizer_config.json only prepends a BOS the post-processor did not add.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# How many tokens before the read offset the incremental detokenizer re-decodes, so that decoders
# that strip or merge at the start of a sequence (sentencepiece's leading space) see context.
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _compile_chat_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """One checkpoint's tokenizer: encode, decode, special ids, chat template."""

    def __init__(
        self,
        hf_tokenizer: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        source_dir: Path | None = None,
    ) -> None:
        self._tok = hf_tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._add_bos_token = add_bos_token
        self._chat_template_source = chat_template
        self._chat_template: jinja2.Template | None = None
        self.source_dir = source_dir
        self.bos_token_id: int | None = hf_tokenizer.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        eos_id = hf_tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in hf_tokenizer.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from an HF checkpoint directory, or a GGUF file (its vocabulary, materialized as an
        HF directory by engine.models.gguf_tokenizer); raises FileNotFoundError without tokenizer.json."""
        path = Path(path)
        if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
            from engine.models.gguf_tokenizer import checkpoint_dir  # NOTE: lazy: it imports torch

            gguf, path = path, checkpoint_dir(path)
            if not (path / TOKENIZER_FILE).is_file():
                raise FileNotFoundError(
                    f"{gguf}: its tokenizer (tokenizer.ggml.model) is not byte-level BPE ('gpt2'), the only GGUF "
                    "vocabulary pdserve builds; pass prompts as token ids, or name a directory holding the "
                    "model's HF tokenizer.json beside the .gguf file"
                )
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{TOKENIZER_FILE} not found in {path}: pdserve needs a fast (HF tokenizers) tokenizer file there"
            )
        tok_config = _read_json(path / TOKENIZER_CONFIG_FILE)
        # Stop ids: generation_config.json wins over config.json; the tokenizer's eos token is added.
        eos_ids = _as_id_tuple(_read_json(path / "generation_config.json").get("eos_token_id"))
        if not eos_ids:
            eos_ids = _as_id_tuple(_read_json(path / "config.json").get("eos_token_id"))
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}], transformers picks "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        if (path / CHAT_TEMPLATE_FILE).is_file():
            template = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(
            _HFTokenizer.from_file(str(tokenizer_file)),
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            add_bos_token=tok_config.get("add_bos_token"),
            eos_token_ids=eos_ids,
            chat_template=template,
            source_dir=path,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self._add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render messages to the prompt text (not tokenized) with the checkpoint's jinja template;
        `tools` (OpenAI function tools) are the template's `tools` variable, as transformers passes them."""
        if self._chat_template_source is None:
            where = self.source_dir / TOKENIZER_CONFIG_FILE if self.source_dir else TOKENIZER_CONFIG_FILE
            raise ValueError(
                f"this tokenizer has no chat template: 'chat_template' is missing from {where}; "
                "add one there, or send a plain completion prompt instead of chat messages"
            )
        if self._chat_template is None:
            self._chat_template = _compile_chat_template(self._chat_template_source)
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )


class IncrementalDetokenizer:
    """Turns a request's output ids into text as they arrive, never splitting a UTF-8 character.

    vLLM's prefix_offset/read_offset scheme, over ids. `ids[prefix_offset:read_offset]` is text
    already returned, kept as context; `ids[read_offset:]` is not returned yet. Each `add` decodes
    both windows; the difference is new text, unless the decoding ends in U+FFFD (a multi-byte
    character split over tokens), in which case it is held until a later token completes it.

    For byte-level BPE the concatenation of `add`'s results equals `tokenizer.decode(output_ids)`
    whenever that decoding does not end in U+FFFD. Text held back when the request ends (an
    incomplete character at the very end) is never returned.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context; +2 covers a split character before it.
        self._ids: list[int] = self._kept(prompt_ids[-(INITIAL_PREFIX_TOKENS + 2):])
        self._prefix_offset = max(len(self._ids) - INITIAL_PREFIX_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []

    def _kept(self, ids: Sequence[int]) -> list[int]:
        if not self._skip_special_tokens:
            return list(ids)
        special = self._tokenizer.special_token_ids
        return [i for i in ids if i not in special]

    @property
    def text(self) -> str:
        """All output text returned so far."""
        return "".join(self._pieces)

    def add(self, new_token_ids: list[int]) -> str:
        """Append output ids; return the newly completed text ('' while a character is incomplete).
        Several ids at once (a speculative step, or a router catching up) give the text they would
        give one by one: when the last of them leaves a character incomplete, the text the ones
        before it complete is still returned."""
        new_ids = self._kept(new_token_ids)
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        text = self._read_to(len(self._ids))
        if text is not None or len(new_ids) == 1:
            return text or ""
        pieces = [self._read_to(end) for end in range(self._read_offset + 1, len(self._ids))]
        return "".join(p for p in pieces if p)

    def _read_to(self, end: int) -> str | None:
        """The text ids[read_offset:end] add, and reads up to `end`; None (nothing read) while the
        decoding ends inside a character or adds nothing."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=False)
        full_text = decode(self._ids[self._prefix_offset:end], skip_special_tokens=False)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return None
        new_text = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._pieces.append(new_text)
        return new_text
