"""The engine on a GPU (skipped without one): verify mode is exactly the base's greedy output there too, compress
and trust run, in float32 and bfloat16. `benchmarks/gpu_run.sh receive --tests` runs these on a lent GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import base_greedy, hamburger, random_merger
from hamburger.inference.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_verify_equals_the_base_greedy_output(arch):
    model = hamburger(arch, k=4).to("cuda")
    engine = Engine(model, draft_rows=None)
    out = engine.generate(PROMPTS, max_new_tokens=24, confidence=0.3, mode="verify")
    for i, prompt in enumerate(PROMPTS):
        assert out.tokens[i] == base_greedy(model, prompt, 24), (arch, i)
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_trust_and_compress_run(dtype):
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    model = model.to("cuda", dtype)
    engine = Engine(model, draft_rows=None)
    for mode in ("trust", "compress"):
        out = engine.generate(PROMPTS, max_new_tokens=16, confidence=0.3, mode=mode)
        assert all(len(t) > 0 for t in out.tokens), mode
        assert out.stats.kv_entries <= out.stats.kv_entries_base


def test_gpu_and_cpu_agree_in_float32():
    model = hamburger("llama", k=4)
    cpu = Engine(model, draft_rows=None).generate(PROMPTS, max_new_tokens=16, mode="verify").tokens
    gpu = Engine(model.to("cuda"), draft_rows=None).generate(PROMPTS, max_new_tokens=16, mode="verify").tokens
    assert gpu == cpu
