"""hamburger.model.tokenizer.Tokenizer gives transformers' results on the same folder, without importing it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

from conftest import tiny_tokenizer
from hamburger.errors import HamburgerError
from hamburger.model.tokenizer import MODEL_TYPES, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# uses what transformers adds to templates: special-token variables, tojson, namespace, raise_exception, generation
RICH = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['role'] }}: {{ m['content'] | tojson }}{% endif %}"
    "{% if m.thinking is defined %}[{{ m.thinking }}]{% endif %}\n{% endfor %}"
    "{{ ns.n }} {{ tools | tojson }} {{ extra | default('-') }}{{ eos_token }}"
)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hamburgers", "sizzle", "on",
         "grill", "and", "tokens", "merge", "into", "steps", ";", "numbers", "12", "345", "6789", ",", "punctuation",
         "!", "?", ".", "don't", "can't", "I'm", "it's", "we've", "they're"]
STRINGS = [
    "", " ", "  ", "\n", "\n\n", "\t", "Hello world", "Hello world!", " leading space", "trailing space ",
    "multiple   spaces   inside", "line one\nline two\n", "  both ends  ", "Hello , world .", "Hi ! How are you ?",
    "it 's fine , is n't it ?", "I 'm here and we 've seen they 're ' quoted ' .", "don't can't won't",
    "héllo wörld café naïve", "日本語のテキスト", "Привет, мир", "emoji 🍔🍟 and 👩‍💻", "🙂", "mixed 123 and 4.56e7",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n", "text<|im_end|>more",
    " <|im_start|> spaced <|im_end|> ", "<|im_start|><|im_start|>", "<|im_end", "|im_start|>", "<| im_start |>",
    "code: def f(x):\n    return x * 2\n", "tabs\tand\ttabs", "a" * 50, "The quick brown fox.", "x,y;z:w",
    "quotes \"double\" and 'single'", "back\\slash", "\u00a0non-breaking space", "zero\u200bwidth",
    "Ünïcödé ŧëxŧ with àccents", "math ∑ ∫ √ ≤ ≥", "CJK 中文 mixed English", "Ends with newline\n",
    "\r\nwindows line\r\n", "a , b . c ! d ? e", "  ,  .  ", "repeat repeat repeat repeat",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🍔"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": " spaced <|im_end|> text "},
     {"role": "assistant", "content": "ok", "tool_calls": None}, {"role": "user", "content": "again\n"}],
]


def corpus(lines: int = 300) -> list[str]:
    rng = random.Random(0)
    extra = [s for s in STRINGS if "<|" not in s]
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) + rng.choice(["", ".", "\n", " "])
            for _ in range(lines)] + extra * 3


def byte_level_bpe(bos_processor: bool = False) -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(), trainer=trainer)
    if bos_processor:
        start, end = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|endoftext|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|endoftext|>", pair="<|im_start|> $A $B:1 <|endoftext|>",
            special_tokens=[("<|im_start|>", start), ("<|endoftext|>", end)])
    return backend


def word_piece() -> Backend:
    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[PAD]", *SPECIALS],
                                        show_progress=False)
    backend.train_from_iterator(corpus(), trainer=trainer)
    return backend


def save(folder, backend, template=SMOL, **kwargs):
    tokens = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
              "pad_token": "<|im_end|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokens, **kwargs})
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    conftest_folder = root / "conftest"
    tiny_tokenizer().save_pretrained(conftest_folder)
    (conftest_folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        "bpe": save(root / "bpe", byte_level_bpe()),
        "bos": save(root / "bos", byte_level_bpe(bos_processor=True), template=RICH),
        "bpe_cleanup": save(root / "bpe_cleanup", byte_level_bpe(), clean_up_tokenization_spaces=True),
        "bpe_forced_cleanup": save(
            root / "bpe_forced", byte_level_bpe(), clean_up_tokenization_spaces=True,
            clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True),
        "wordpiece_cleanup": save(root / "wordpiece", word_piece(), unk_token="[UNK]", pad_token="[PAD]",
                                  clean_up_tokenization_spaces=True),
        "conftest": conftest_folder,
    }


@pytest.fixture(params=["bpe", "bos", "bpe_cleanup", "bpe_forced_cleanup", "wordpiece_cleanup", "conftest"])
def pair(request, folders):
    folder = folders[request.param]
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours is not None and type(theirs).__name__ == "TokenizersBackend"
    return ours, theirs


def assert_same_encoding(ours, theirs, strings=STRINGS):
    for text in strings:
        for add in (True, False):
            expected = theirs(text, add_special_tokens=add)
            assert ours(text, add_special_tokens=add) == dict(expected), (text, add)
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)


def assert_same_decoding(ours, theirs, strings=STRINGS):
    specials = [i for i in (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id) if i is not None]
    for n, text in enumerate(strings):
        ids = theirs(text)["input_ids"]
        mixed = ids[: n % 4] + specials + ids[n % 4:] + specials[:1]
        for sequence in (ids, mixed, torch.tensor(mixed, dtype=torch.long)):
            for skip in (False, True):
                assert ours.decode(sequence, skip_special_tokens=skip) == theirs.decode(sequence, skip_special_tokens=skip)
    assert ours.decode([]) == theirs.decode([]) and ours.decode(specials[0]) == theirs.decode(specials[0])


def assert_same_chats(ours, theirs, chats=CHATS, **variables):
    for chat in chats:
        for prompt in (False, True):
            for options in ({"tokenize": False}, {"tokenize": True}, {"tokenize": True, "return_dict": False},
                            {"tokenize": True, "return_dict": True}, {}):
                got = ours.apply_chat_template(chat, add_generation_prompt=prompt, **options, **variables)
                expected = theirs.apply_chat_template(chat, add_generation_prompt=prompt, **options, **variables)
                assert type(got) is type(expected) or {type(got), type(expected)} <= {dict, BatchEncoding}
                assert got == (expected if isinstance(expected, (str, list)) else dict(expected)), (chat, options)


def assert_same_attributes(ours, theirs, name_or_path=True):
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "vocab_size", "chat_template") + (("name_or_path",) if name_or_path else ()):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def test_encode_decode_and_attributes_equal_transformers(pair):
    ours, theirs = pair
    assert_same_attributes(ours, theirs)
    assert_same_encoding(ours, theirs)
    assert_same_decoding(ours, theirs)


def test_chat_templates_equal_transformers(pair):
    assert_same_chats(*pair)


def test_rich_template_features_equal_transformers(folders):
    ours, theirs = Tokenizer.from_folder(folders["bos"]), AutoTokenizer.from_pretrained(str(folders["bos"]))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert_same_chats(ours, theirs, extra="x", tools=tools)
    assert_same_chats(ours, theirs, chats=[[{"role": "user", "content": "q", "reasoning_content": "r"}]],
                      eos_token="<override>")
    assert "<|im_start|>" in ours.apply_chat_template(CHATS[0], tokenize=False)  # the bos_token variable
    with pytest.raises(Exception, match="bad role") as raised:
        ours.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(type(raised.value), match="bad role"):
        theirs.apply_chat_template([{"role": "bad", "content": "x"}])


def test_bos_post_processor_makes_add_special_tokens_matter(folders):
    ours = Tokenizer.from_folder(folders["bos"])
    assert ours.encode("hi") == [ours.bos_token_id, *ours.encode("hi", add_special_tokens=False), ours.unk_token_id]
    assert ours.apply_chat_template(CHATS[0], return_dict=False)[0] == ours.bos_token_id  # from the template only


def test_cleanup_rule_applies_only_where_transformers_applies_it(folders):
    text = "Hello , world . it 's"
    for name, cleaned in [("bpe", False), ("bpe_cleanup", False), ("bpe_forced_cleanup", True)]:
        ours = Tokenizer.from_folder(folders[name])
        assert ours.decode(ours.encode(text)) == ("Hello, world. it's" if cleaned else text), name
    wordpiece = Tokenizer.from_folder(folders["wordpiece_cleanup"])
    assert " ," not in wordpiece.decode(wordpiece.encode("a , b"))


def test_pad_token_setter_and_save_round_trip(folders, tmp_path):
    ours, theirs = Tokenizer.from_folder(folders["bpe"]), AutoTokenizer.from_pretrained(str(folders["bpe"]))
    for value in ("<|endoftext|>", "<not-a-token>", None, "<|im_start|>"):
        ours.pad_token = theirs.pad_token = value
        assert (ours.pad_token, ours.pad_token_id) == (theirs.pad_token, theirs.pad_token_id), value
    with pytest.raises(ValueError):
        ours.pad_token = 3
    ours.save_pretrained(tmp_path / "saved")
    assert {p.name for p in (tmp_path / "saved").iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                                  "chat_template.jinja"}
    again, loaded = Tokenizer.from_folder(tmp_path / "saved"), AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again is not None and type(loaded).__name__ == "TokenizersBackend"
    assert again.pad_token == loaded.pad_token == "<|im_start|>"
    assert_same_attributes(again, loaded)
    assert_same_attributes(again, ours, name_or_path=False)
    for reloaded in (again, loaded):
        assert_same_encoding(reloaded, theirs, STRINGS[::5])
        assert_same_decoding(reloaded, theirs, STRINGS[::5])
        assert_same_chats(reloaded, theirs, CHATS[:2])


def test_save_without_template_and_with_stale_special_tokens_map(folders, tmp_path):
    folder = save(tmp_path / "plain", byte_level_bpe(), template=None)
    ours = Tokenizer.from_folder(folder)
    assert ours.chat_template is None
    with pytest.raises(HamburgerError, match="no chat template"):
        ours.apply_chat_template(CHATS[0])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    ours.pad_token = "<|im_start|>"
    ours.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert Tokenizer.from_folder(tmp_path / "out").pad_token == loaded.pad_token == "<|im_start|>"


def test_arguments_that_are_not_reproduced_raise(folders):
    ours = Tokenizer.from_folder(folders["bpe"])
    with pytest.raises(TypeError):
        ours(["a", "b"])
    with pytest.raises(TypeError):
        ours.encode(None)
    for bad in ({"continue_final_message": True}, {"return_tensors": "pt"}, {"padding": True},
                {"truncation": True, "max_length": 3}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            ours.apply_chat_template(CHATS[0], **bad)
    with pytest.raises(TypeError, match="batch"):
        ours.apply_chat_template([CHATS[0], CHATS[1]])
    with pytest.raises(ValueError, match="empty"):
        ours.apply_chat_template([])
    assert ours.apply_chat_template(CHATS[0], padding=False, return_tensors=None) == ours.apply_chat_template(CHATS[0])


def edited(folder, tmp_path, config=None, files=None):
    out = tmp_path / "edited"
    out.mkdir()
    for path in folder.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    data = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**data, **(config or {})}))
    for name, text in (files or {}).items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text) if text is not None else (out / name).unlink()
    return out


@pytest.mark.parametrize("config,files", [
    ({"chat_template": [{"name": "default", "template": SMOL}, {"name": "tool_use", "template": SMOL}]},
     {"chat_template.jinja": None}),  # the .jinja file would win over the list
    ({"tokenizer_class": "GPT2Tokenizer"}, None),
    ({"tokenizer_class": None}, None),
    ({"add_prefix_space": True}, None),
    ({"legacy": False}, None),
    ({"split_special_tokens": True}, None),
    ({"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}, None),
    ({"bos_token": "<not-added>"}, None),
    ({"bos_token": "hello"}, None),  # in the vocabulary but not a special added token
    ({"extra_special_tokens": ["<new>"]}, None),
    ({"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "special": False}}}, None),
    (None, {"config.json": json.dumps({"model_type": "qwen2"})}),
    (None, {"config.json": "{not json"}),
    (None, {"additional_chat_templates/tool_use.jinja": SMOL}),
    (None, {"special_tokens_map.json": json.dumps({"image_token": "<|im_start|>"})}),
])
def test_unsupported_folders_give_none(folders, tmp_path, config, files):
    assert Tokenizer.from_folder(edited(folders["bpe"], tmp_path, config, files)) is None


def test_folders_without_tokenizer_json_give_none(folders, tmp_path):
    folder = edited(folders["bpe"], tmp_path)
    (folder / "tokenizer.json").unlink()
    assert Tokenizer.from_folder(folder) is None
    assert Tokenizer.from_folder(tmp_path / "missing") is None


def test_supported_edits_match_transformers(folders, tmp_path):
    """A chat template in the config, a special_tokens_map.json, a model-specific token and a llama config.json."""
    folder = edited(folders["bpe"], tmp_path, {"chat_template": RICH, "image_token": "<|im_start|>"}, {
        "special_tokens_map.json": json.dumps({"pad_token": {"content": "<|endoftext|>"}}),
        "config.json": json.dumps({"model_type": "llama"}), "chat_template.jinja": None})
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.pad_token == "<|endoftext|>" and ours.chat_template == RICH
    assert_same_attributes(ours, theirs)
    assert_same_chats(ours, theirs, CHATS[:2])
    assert_same_encoding(ours, theirs, STRINGS[::7])
    ours.pad_token = "<|im_end|>"
    ours.save_pretrained(tmp_path / "saved")
    again, loaded = Tokenizer.from_folder(tmp_path / "saved"), AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again.pad_token == loaded.pad_token == "<|im_end|>" and loaded.image_token == "<|im_start|>"
    assert_same_attributes(again, loaded)
    assert_same_chats(again, loaded, CHATS[:2])
    probe = "{{ image_token }}|{{ pad_token }}|{{ sep_token is defined }}"  # special tokens are template variables
    assert again.apply_chat_template(CHATS[0], chat_template=probe, tokenize=False) == loaded.apply_chat_template(
        CHATS[0], chat_template=probe, tokenize=False) == "<|im_start|>|<|im_end|>|False"


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_model_types_load_as_tokenizers_backend(folders, tmp_path, model_type, tokenizer_class):
    from transformers.models.auto import tokenization_auto

    assert model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    folder = edited(folders["bpe"], tmp_path, {"tokenizer_class": tokenizer_class},
                    files={"config.json": json.dumps({"model_type": model_type})})
    assert type(AutoTokenizer.from_pretrained(str(folder))).__name__ == "TokenizersBackend"
    assert Tokenizer.from_folder(folder) is not None


def test_import_does_not_import_transformers():
    code = ("import sys; from hamburger.model.tokenizer import Tokenizer; "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_default_model_tokenizer_equals_transformers():
    from hamburger.model.base import cache_dir, load_base

    _, theirs = load_base("default")
    root = cache_dir()
    folders = sorted(root.glob("SmolLM2-135M-Instruct-*")) if root is not None else []
    if not folders or not (folders[-1] / "tokenizer.json").is_file():
        pytest.skip("no converted default model folder in the cache")
    ours = Tokenizer.from_folder(folders[-1])
    assert ours is not None
    ours.pad_token = theirs.pad_token  # load_base sets one when the folder has none
    assert_same_attributes(ours, theirs, name_or_path=False)
    assert_same_encoding(ours, theirs)
    assert_same_decoding(ours, theirs)
    assert_same_chats(ours, theirs)
