"""engine.tokenizer on the embedded default model: round trips, incremental detokenization, chat
templates (checked against transformers), and the errors a bad checkpoint directory gives."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jinja2
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

DEFAULT_DIR = REPO_ROOT / "engine" / "models" / "default"
TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Crème brûlée, naïve façade, Ångström",
    "你好，世界！日本語のテキスト",
    "emoji 🎉👍🏽 and family 👨‍👩‍👧 done",
    "mixed: héllo 世界 🚀\n\tend",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in 中文 🎉"},
    {"role": "assistant", "content": "你好"},
    {"role": "user", "content": "Again."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_DIR)


def _checkpoint_copy(tmp_path: Path, tokenizer_config: dict | None = None, **json_files: object) -> Path:
    shutil.copy(DEFAULT_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, obj in json_files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(obj))
    return tmp_path


def test_special_ids_and_vocab(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 2048
    assert tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_ids == (1, 3)  # <|end_of_text|>, <|im_end|> from generation_config.json


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_one_token_at_a_time(tokenizer: Tokenizer, text: str) -> None:
    prompt_ids = tokenizer.encode("prompt: ✓ ")
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    pieces = [detok.add([token_id]) for token_id in output_ids]
    assert "".join(pieces) == tokenizer.decode(output_ids) == text
    assert detok.text == text
    assert not any("\ufffd" in piece for piece in pieces)
    if any(len(ch.encode()) > 1 for ch in text):
        assert "" in pieces  # some character was split over tokens and held back


def test_incremental_detokenization_chunks_and_special_tokens(tokenizer: Tokenizer) -> None:
    text = "<|im_start|>assistant\nça va 🎉<|im_end|>"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        pieces = [detok.add(output_ids[i:i + 3]) for i in range(0, len(output_ids), 3)]
        assert "".join(pieces) == tokenizer.decode(output_ids, skip_special_tokens=skip)
        assert not any("\ufffd" in piece for piece in pieces)
    assert detok.text == text



def test_several_ids_at_once_give_the_text_one_at_a_time_gives(tokenizer: Tokenizer) -> None:
    """Ids added in groups (a speculative step; a router handed several steps' tokens at once)
    whose last id leaves a character incomplete: the text the ids before it complete still comes
    out. The first case is what the embedded model answers to the chat prompt "hi" (its last token
    is half a character); added as one group it once gave no text at all."""
    import random

    chat = [2, 1451, 202, 75, 76, 3, 202, 2, 312, 363, 278, 1185, 202]
    cases = [(chat, [1781, 1733, 1081, 1862, 714, 239])]
    rng = random.Random(0)
    cases += [([rng.randrange(4, 2048) for _ in range(8)], [rng.randrange(4, 2048) for _ in range(24)])
              for _ in range(40)]
    for prompt, output in cases:
        one = IncrementalDetokenizer(tokenizer, prompt)
        expected = "".join(one.add([t]) for t in output)
        for _ in range(5):
            grouped, pieces, i = IncrementalDetokenizer(tokenizer, prompt), [], 0
            while i < len(output):
                n = rng.randrange(1, 8)
                pieces.append(grouped.add(output[i:i + n]))
                i += n
            assert "".join(pieces) == expected, (prompt, output)  # random ids: U+FFFD mid-text included
    assert IncrementalDetokenizer(tokenizer, chat).add([1781, 1733, 1081, 1862, 714, 239]) == "removeormal `platform en"

def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as excinfo:
        Tokenizer.from_dir(tmp_path)
    assert "tokenizer.json" in str(excinfo.value)
    assert str(tmp_path) in str(excinfo.value)


def test_chat_template_matches_transformers(tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(DEFAULT_DIR)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected
    for text in TEXTS:
        assert tokenizer.encode(text) == hf(text).input_ids


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_checkpoint_copy(tmp_path, {"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(ValueError, match="no chat template") as excinfo:
        tok.apply_chat_template(MESSAGES)
    assert str(tmp_path / "tokenizer_config.json") in str(excinfo.value)


def test_chat_template_helpers(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}"
    )
    config = {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|im_end|>", "chat_template": template}
    tok = Tokenizer.from_dir(_checkpoint_copy(tmp_path, config))
    rendered = tok.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert rendered == '<|begin_of_text|>{"role": "user", "content": "é<b>"}<|im_end|>'
    with pytest.raises(jinja2.exceptions.TemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"generation_config": {"eos_token_id": 3}}, (3, 1)),
        ({"generation_config": {"eos_token_id": [1, 3]}}, (1, 3)),
        ({"config": {"eos_token_id": 2}}, (2, 1)),
        ({"config": {"eos_token_id": [2, 3]}, "generation_config": {"eos_token_id": 1}}, (1,)),
    ],
)
def test_eos_ids_as_int_or_list(tmp_path: Path, files: dict, expected: tuple[int, ...]) -> None:
    tok = Tokenizer.from_dir(_checkpoint_copy(tmp_path, {"eos_token": "<|end_of_text|>"}, **files))
    assert tok.eos_token_ids == expected


def test_eos_ids_without_any_config(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_checkpoint_copy(tmp_path))
    assert tok.eos_token_ids == ()
    assert tok.bos_token_id is None
