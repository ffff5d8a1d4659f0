"""Tokenizer wrapper: byte-level round trip, out-of-vocab ids, streaming detokenisation, chat templates."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splash.errors import ConfigError
from splash.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    IncrementalDetokenizer,
    load_tokenizer,
    save_byte_tokenizer,
)

TOK = load_tokenizer(None, 512)
_no_specials = st.text().filter(lambda s: not any(t in s for t in BYTE_SPECIAL_TOKENS))


def test_byte_tokenizer_layout():
    assert TOK.vocab_size == 260
    assert [TOK.hf.token_to_id(t) for t in BYTE_SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert TOK.eos_token_id == 257 and TOK.bos_token_id == 256
    assert TOK.encode("A é") == [0x41, 0x20, 0xC3, 0xA9]  # ids are the UTF-8 bytes


@settings(max_examples=300, deadline=None)
@given(_no_specials)
def test_byte_round_trip(text):
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text


def test_special_tokens_encode_and_skip():
    ids = TOK.encode("hi<|eos|>")
    assert ids == [104, 105, 257]
    assert TOK.decode(ids) == "hi" and TOK.decode(ids, skip_special_tokens=False) == "hi<|eos|>"


def test_out_of_vocab_and_negative_ids_are_dropped():
    assert TOK.decode([104, 300, 511, 10**9, -1, 105]) == "hi"
    assert TOK.decode([0x80]) == "\ufffd"  # a lone continuation byte


def test_byte_tokenizer_needs_vocab():
    with pytest.raises(ConfigError, match="260"):
        load_tokenizer(None, 100)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-2, max_value=300), max_size=40))
def test_incremental_matches_full_decode_random_ids(ids):
    det = IncrementalDetokenizer(TOK)
    streamed = "".join(det.push(i) for i in ids) + det.flush()
    assert streamed == TOK.decode(ids)


@settings(max_examples=100, deadline=None)
@given(_no_specials)
def test_incremental_never_emits_partial_characters(text):
    det = IncrementalDetokenizer(TOK)
    pieces = [det.push(i) for i in TOK.encode(text)]
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)
    assert "".join(pieces) + det.flush() == text


def test_incremental_holds_multibyte_until_complete():
    det = IncrementalDetokenizer(TOK)
    assert [det.push(b) for b in "€".encode()] == ["", "", "€"]
    assert det.flush() == ""


def test_simple_chat_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    text = TOK.apply_chat_template(msgs)
    assert text == ("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello\n"
                    "<|user|>\nagain\n<|assistant|>\n")
    ids = TOK.encode(text)
    assert ids[-2:] == [259, 10] and 258 in ids


def test_saved_byte_tokenizer_loads_from_dir(tmp_path):
    save_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, 300)
    assert tok.eos_token_id == 257 and tok.encode("ok") == [111, 107] and tok.decode([111, 107]) == "ok"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


def test_dir_without_tokenizer_json_falls_back_to_bytes(tmp_path):
    assert load_tokenizer(tmp_path, 300).vocab_size == 260


def test_missing_dir_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(tmp_path / "nope", 300)


def test_jinja_chat_template_from_tokenizer_config(tmp_path):
    save_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path, 300)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|bos|>[user]hi[assistant]"


def test_jinja_template_raise_exception_is_value_error(tmp_path):
    save_byte_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    tok = load_tokenizer(tmp_path, 300)
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_from_model_config_when_tokenizer_config_lacks_it(tmp_path):
    save_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [257, 1]}))
    assert load_tokenizer(tmp_path, 300).eos_token_id == 257
