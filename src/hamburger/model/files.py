"""Reading the files a model is made of, with one error that names the file and says what is wrong (a truncated or
corrupted safetensors file, a config that is not JSON, weights of the wrong shapes) instead of a library's
traceback: the CLI turns it into one line and exit status 2, the server into a failed start-up."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hamburger.errors import HamburgerError


def read_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise HamburgerError(f"{path}: missing")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise HamburgerError(f"{path}: not a readable safetensors file, truncated or corrupted? ({exc})") from exc


def read_json(path: str | Path) -> dict:
    """A JSON object from a file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise HamburgerError(f"{path}: missing") from exc
    except (OSError, ValueError) as exc:
        raise HamburgerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise HamburgerError(f"{path}: a JSON object was expected, found {type(data).__name__}")
    return data


def load_state(module: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path, **kwargs):
    """`module.load_state_dict(state, **kwargs)`, a mismatch of shapes reported against the file it came from."""
    try:
        return module.load_state_dict(state, **kwargs)
    except RuntimeError as exc:
        shapes = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line][:3]
        raise HamburgerError(f"{path}: its weights do not fit this model ({'; '.join(shapes) or exc})") from exc
