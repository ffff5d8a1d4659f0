"""Tokenizer wrapper over the HF ``tokenizers`` library (no torch, no transformers).

A model directory with ``tokenizer.json`` uses it (BOS/EOS and the chat template from ``tokenizer_config.json`` or
``chat_template.jinja``). Otherwise (presets) a byte-level tokenizer: ids 0..255 are the bytes (GPT-2's
byte→unicode alphabet, no merges), then the special tokens ``<|bos|>`` = 256, ``<|eos|>`` = 257, ``<|user|>`` =
258, ``<|assistant|>`` = 259. ``decode`` drops ids outside the vocabulary (a random-weight model's is often
larger). Without a Jinja template the chat template is ``<|{role}|>\\n{content}\\n`` per message, then
``<|assistant|>\\n``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from splash.chat_template import render
from splash.errors import ConfigError

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>")
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes stand for themselves, the others for
    256, 257, … in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def build_byte_tokenizer() -> HFTokenizer:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == BYTE_VOCAB_SIZE
    return tok


def save_byte_tokenizer(directory: str | Path) -> Path:
    """Write the byte tokenizer's ``tokenizer.json`` and ``tokenizer_config.json`` into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _pick_template(raw: Any) -> str | None:
    """A string, or (older HF) a list of {"name", "template"}: take 'default'."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


class Tokenizer:
    def __init__(self, hf: HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, eos_token_id: int | None = None) -> None:
        self.hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = hf.token_to_id(eos_token) if eos_token else None
        if self.eos_token_id is None:
            self.eos_token_id = eos_token_id
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in ``text`` map to their ids; ``add_special_tokens`` runs the post-processor."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` of each text, releasing the GIL while it works (``encode`` holds it throughout)."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        valid = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.hf.decode(valid, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """The prompt text of OpenAI-style ``messages``: the model's Jinja template with ``tools`` and
        ``chat_template_kwargs`` (splash.chat_template; ValueError when it raises), else the simple template."""
        if self.chat_template is not None:
            special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
            return render(self.chat_template, list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                          special_tokens=special, kwargs=kwargs)
        parts = [f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


def _eos_from_model_config(directory: Path) -> int | None:
    """eos_token_id from generation_config.json / config.json (int, or the first of a list)."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _load_from_dir(directory: Path) -> Tokenizer:
    path = directory / "tokenizer.json"
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises plain Exception subclasses
        raise ConfigError(f"{path}: cannot load tokenizer ({e})") from None
    cfg = _read_json(directory / "tokenizer_config.json")
    template = _pick_template(cfg.get("chat_template"))
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return Tokenizer(hf, bos_token=_token_content(cfg.get("bos_token")),
                     eos_token=_token_content(cfg.get("eos_token")), chat_template=template,
                     eos_token_id=_eos_from_model_config(directory))


def load_tokenizer(model_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The tokenizer for a model whose embedding has ``vocab_size`` rows (the byte tokenizer needs 260)."""
    if model_dir is not None:
        directory = Path(model_dir)
        if not directory.is_dir():
            raise ConfigError(f"{directory}: tokenizer directory not found")
        if (directory / "tokenizer.json").is_file():
            return _load_from_dir(directory)
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(f"the byte tokenizer needs vocab_size >= {BYTE_VOCAB_SIZE}, the model has {vocab_size}")
    return Tokenizer(build_byte_tokenizer(), bos_token="<|bos|>", eos_token="<|eos|>")


class IncrementalDetokenizer:
    """``push(id)`` returns the newly completed text, ``flush()`` the rest; together they equal ``decode``.

    Text is released once it no longer ends in U+FFFD (a character split across tokens), as the difference of
    two decodes of a short window, so decoders that depend on context (leading spaces) stream correctly."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0   # start of the decode window (text before it is already released)
        self._read = 0     # end of the released part of the window

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        released = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(released) and not window.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return window[len(released):]
        return ""

    def flush(self) -> str:
        released = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return window[len(released):]
