"""`hamburger.vllm.media`: a media package that cannot import (the registry's CUDA torchvision on a CPU-only torch)
is marked absent, so that transformers and vLLM import without it; one that imports is left alone."""

from __future__ import annotations

import importlib.util
import sys
import types

from hamburger.vllm import media


def test_a_package_that_fails_to_import_is_marked_absent_and_one_that_imports_is_left(tmp_path, monkeypatch):
    (tmp_path / "hb_broken_media").mkdir()
    (tmp_path / "hb_broken_media" / "__init__.py").write_text(
        "from hb_broken_media import part\n")
    (tmp_path / "hb_broken_media" / "part.py").write_text(
        "raise RuntimeError('operator hb_broken_media::nms does not exist')\n")
    (tmp_path / "hb_fine_media.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(media, "MEDIA_PACKAGES", ("hb_broken_media", "hb_fine_media", "hb_not_installed_media"))
    try:
        assert media.shield_vision() == ["hb_broken_media"]
        assert sys.modules["hb_broken_media"] is None and "hb_broken_media.part" not in sys.modules
        assert importlib.util.find_spec("hb_broken_media") is None  # how transformers asks
        assert sys.modules["hb_fine_media"].VALUE == 1
        assert media.shield_vision() == ["hb_broken_media"]  # again: the same answer
    finally:
        for name in ("hb_broken_media", "hb_broken_media.part", "hb_fine_media"):
            sys.modules.pop(name, None)


def test_vllms_registry_child_shields_them_too(monkeypatch):
    """vLLM inspects a model's class in a child process (`python -m vllm.model_executor.models.registry`) that
    imports nothing of ours: where a package was shielded, that child runs the shield first, then the same module."""
    registry = types.SimpleNamespace(_SUBPROCESS_COMMAND=[sys.executable, "-m", "vllm.model_executor.models.registry"])
    monkeypatch.setattr(media, "_vllm_registry", lambda: registry)
    assert media.shield_children()
    assert registry._SUBPROCESS_COMMAND == [sys.executable, "-c", media.REGISTRY_CHILD]
    assert "shield_vision()" in media.REGISTRY_CHILD and "run_module('vllm.model_executor.models.registry'" in \
        media.REGISTRY_CHILD
    assert media.shield_children()  # told already: left as it is
    assert registry._SUBPROCESS_COMMAND == [sys.executable, "-c", media.REGISTRY_CHILD]
    other = types.SimpleNamespace(_SUBPROCESS_COMMAND=[sys.executable, "-m", "something.else"])
    monkeypatch.setattr(media, "_vllm_registry", lambda: other)
    assert not media.shield_children() and other._SUBPROCESS_COMMAND[1:] == ["-m", "something.else"]
    monkeypatch.setattr(media, "_vllm_registry", lambda: None)
    assert not media.shield_children()
