"""bf16 autocast in training only where bfloat16 is native (on an AVX2-only CPU it is 8x slower than float32)."""

from __future__ import annotations

import torch

from hamburger.training.precision import bf16_autocast


def test_bf16_only_where_native(monkeypatch, capsys):
    assert bf16_autocast(False, "cpu") is False and capsys.readouterr().err == ""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert bf16_autocast(True, "cpu") is False
    assert "bf16 autocast off" in capsys.readouterr().err
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert bf16_autocast(True, "cpu") is torch.backends.mkldnn.is_available()
