"""A tokenizer that gives transformers' `TokenizersBackend` results without importing transformers (~2.4 s).
Built on `tokenizers` and `jinja2`; `from_folder` returns None for any folder whose behaviour it does not reproduce."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from hamburger.errors import HamburgerError

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that cannot change what the methods below return (or whose effect they reproduce)
FREE_KEYS = {"tokenizer_class", "chat_template", "model_max_length", "clean_up_tokenization_spaces",
             "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", "added_tokens_decoder",
             "additional_special_tokens", "extra_special_tokens", "padding_side", "truncation_side", "is_local",
             "local_files_only", "add_bos_token", "add_eos_token", "processor_class", "verbose", "response_template",
             "chat_control_tokens", *NAMED}  # add_bos/eos_token: transformers drops them when tokenizer.json exists
FIXED_KEYS = {"backend": "tokenizers", "split_special_tokens": False, "add_prefix_space": False, "errors": "replace",
              "model_input_names": ["input_ids", "attention_mask"]}
CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}  # both load as transformers' TokenizersBackend
# config.json model types for which AutoTokenizer honours tokenizer_class (tests check transformers' tables)
MODEL_TYPES = {"llama", "gpt2", "qwen3", "smollm3"}
# apply_chat_template options of transformers that are not reproduced: only their default values are accepted
UNSUPPORTED = {"continue_final_message": False, "sanitize_control_tokens": False, "padding": False,
               "truncation": False, "max_length": None, "return_tensors": None, "return_assistant_tokens_mask": False,
               "tokenizer_kwargs": None}
REASONING = ("reasoning_content", "thinking", "reasoning")
CLEAN_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")  # each loses its first space


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _named(value, legacy: bool = False):
    """A named special token's string from a config value; False where transformers would not read one."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return False
    return value["content"] if legacy or value.get("__type") == "AddedToken" else False


def _config_supported(folder: Path, config: dict) -> bool:
    if config.get("tokenizer_class") not in CLASSES or (folder / "additional_chat_templates").exists():
        return False
    if (folder / "added_tokens.json").exists() and "added_tokens_decoder" not in config:
        return False
    for key, value in config.items():
        model_specific = key.endswith("_token") and key not in NAMED and isinstance(value, str)
        if not (key in FREE_KEYS or model_specific or (key in FIXED_KEYS and FIXED_KEYS[key] == value)):
            return False
    if not (folder / "config.json").exists():
        return True  # AutoTokenizer then goes by tokenizer_class alone
    model = _json(folder / "config.json")
    return isinstance(model, dict) and model.get("model_type") in MODEL_TYPES


def _special_tokens(folder: Path, config: dict) -> tuple[dict, list] | None:
    """(named special tokens incl. model-specific ones, extra special tokens) as transformers resolves them."""
    named = {key: _named(config.get(key)) for key in NAMED}
    named |= {k: v for k, v in config.items() if k.endswith("_token") and k not in NAMED and isinstance(v, str)}
    extras = [config.get("extra_special_tokens") or [], config.get("additional_special_tokens") or []]
    legacy = {}  # special_tokens_map.json overrides the config, unless the config has added_tokens_decoder
    if "added_tokens_decoder" not in config and (folder / "special_tokens_map.json").exists():
        legacy = _json(folder / "special_tokens_map.json")
    if not isinstance(legacy, dict):
        return None
    for key, value in legacy.items():
        if key in NAMED:
            named[key] = _named(value, legacy=True)
        else:  # extra tokens (a list); anything else is not handled here
            extras.append(value if key in ("additional_special_tokens", "extra_special_tokens") else None)
    if any(not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) for tokens in extras):
        return None  # (transformers handles tokens given as dicts differently in different places)
    return (named, [token for tokens in extras for token in tokens]) if False not in named.values() else None


def _plain(value):
    """What transformers' chat templates see of a value: plain JSON-like data, anything else a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return getattr(base, f"__{base.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if (numpy := sys.modules.get("numpy")) is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation) -> list[dict]:
    messages = []
    for message in _plain(list(getattr(conversation, "messages", conversation))):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING if message.get(key) is not None), None)
        messages.append(message if reasoning is None else {"thinking": reasoning, **message,
                                                           "reasoning_content": reasoning})
    return messages


@lru_cache
def _compile(template: str):
    """The template compiled as transformers' `utils/chat_template_utils.py` does."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise HamburgerError(f"chat templates need jinja2>=3.1.6 (sandbox fixes), found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):  # `{% generation %}`: marks assistant text, rendered as is here
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:  # `dict(...)` and `dict.fromkeys(...)` without handing the real type to templates
        __call__, fromkeys = staticmethod(dict), staticmethod(dict.fromkeys)

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace, but got {name!r}. Please rename the attribute.")
        return name

    class TemplateNamespace(jinja2.utils.Namespace):  # rejects underscore attributes, like transformers
        def __init__(*args, **kwargs):
            attrs = dict(*args[1:], **kwargs)
            jinja2.utils.Namespace.__init__(args[0], {check(name): value for name, value in attrs.items()})

        def __setitem__(self, name, value):
            jinja2.utils.Namespace.__setitem__(self, check(name), value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)


class Tokenizer:
    """`encode`/`decode`/`apply_chat_template` and the special tokens of a `tokenizer.json` folder, as transformers."""

    def __init__(self, backend: Backend, config: dict, specials: tuple[dict, list], chat_template, name_or_path):
        self._backend, self._config, self.chat_template, self.name_or_path = backend, config, chat_template, name_or_path
        self._specials, self._extras = dict(specials[0]), specials[1]
        forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        # transformers skips the clean-up for BPE models unless forced
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE" or bool(forced))

    @classmethod
    def from_folder(cls, path) -> Tokenizer | None:
        """The folder's tokenizer, or None when its behaviour under transformers is not clearly reproduced here."""
        folder = Path(path)
        config = _json(folder / "tokenizer_config.json")
        if not (folder / "tokenizer.json").is_file() or not isinstance(config, dict):
            return None
        specials = _special_tokens(folder, config) if _config_supported(folder, config) else None
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if specials is None or not (template is None or isinstance(template, str)):
            return None
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - whatever tokenizers rejects, transformers reports better
            return None
        by_id = {str(i): token.__getstate__() for i, token in backend.get_added_tokens_decoder().items()}
        added = {token["content"]: token for token in by_id.values()}
        wanted = AddedToken("", special=True, normalized=False).__getstate__()
        tokens = [token for token in [*specials[0].values(), *specials[1]] if token is not None]
        if backend.truncation or backend.padding or any(added.get(t) != {**wanted, "content": t} for t in tokens):
            return None  # transformers would change the backend (or a token's flags) when loading it
        saved = config.get("added_tokens_decoder", {})  # must say what tokenizer.json says, flags included
        if not isinstance(saved, dict) or any(by_id.get(key) != value for key, value in saved.items()):
            return None
        return cls(backend, config, specials, template, str(path))

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        index = self._backend.token_to_id(token)
        unk = self._specials.get("unk_token")
        return index if index is not None or unk is None else self._backend.token_to_id(unk)

    bos_token = property(lambda self: self._specials.get("bos_token"))
    eos_token = property(lambda self: self._specials.get("eos_token"))
    unk_token = property(lambda self: self._specials.get("unk_token"))
    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))

    @property
    def pad_token(self) -> str | None:
        return self._specials.get("pad_token")

    @pad_token.setter
    def pad_token(self, value: str | None) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError("Cannot set a non-string value as the pad_token")
        self._specials["pad_token"] = value

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer takes one str, got {type(text).__name__}")
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids, skip_special_tokens: bool = False) -> str | list[str]:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        ids = [ids] if isinstance(ids, int) else list(ids)
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.decode(sequence, skip_special_tokens) for sequence in ids]
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        for old in CLEAN_UP if self._clean_up else ():
            text = text.replace(old, old[1:].replace("' ", "'"))
        return text

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, tools=None, documents=None, chat_template: str | None = None,
                            **kwargs):
        """transformers' `apply_chat_template` for one conversation; other kwargs are template variables."""
        options = {key: kwargs.pop(key) for key in list(kwargs) if key in UNSUPPORTED}
        if bad := sorted(key for key, value in options.items() if value != UNSUPPORTED[key]):
            raise TypeError(f"apply_chat_template here does not support {', '.join(bad)} (transformers does)")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise HamburgerError(f"the tokenizer {self.name_or_path!r} has no chat template: it cannot format chats")
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        first = conversation[0] if isinstance(conversation, (list, tuple)) else None
        if isinstance(first, (list, tuple)) or hasattr(first, "messages"):
            raise TypeError("apply_chat_template here takes one conversation, not a batch")
        if any(not isinstance(tool, dict) for tool in tools or []):
            raise TypeError("tools must be given as JSON schemas (dicts) here")
        if any(not isinstance(document, dict) for document in documents or []):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**{k: v for k, v in self._specials.items() if v is not None}, **kwargs})
        text = _compile(template).render(messages=_messages(conversation), tools=_plain(tools),
                                         documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                         **variables)
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    def save_pretrained(self, directory) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja, loadable here and by transformers."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        dropped = {"chat_template", "additional_special_tokens", "extra_special_tokens", *self._specials}
        config = {key: value for key, value in self._config.items() if key not in dropped}
        config |= {key: value for key, value in self._specials.items() if value is not None}
        config |= {"extra_special_tokens": self._extras} if self._extras else {}
        # added_tokens_decoder makes transformers ignore a special_tokens_map.json left in the folder
        config["added_tokens_decoder"] = {str(i): token.__getstate__()
                                          for i, token in self._backend.get_added_tokens_decoder().items()}
        config["tokenizer_class"] = "TokenizersBackend"
        text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
        if self.chat_template is not None:
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
