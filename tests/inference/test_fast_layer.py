"""The engine's faster paths, each the same computation as the one it replaces: the fast decoder layers
(`inference/fast_layer.py`: the same tokens as the module-by-module layers in every mode, used only where they are
the same computation, and given up when a module they bypass changes) and greedy tokens through `max`."""

from __future__ import annotations

import pytest
import torch

from conftest import hamburger, random_merger
from hamburger.inference.engine import Engine
from hamburger.inference.fast_layer import FastLayer, decode_layers, rope_tables
from hamburger.inference.sampling import greedy_tokens
from hamburger.kernels.qlinear import fp16_unavailable
from hamburger.kernels.quantize import quantize_model

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]
SCHEMES = ("int4", "int8") + (("fp16",) if fp16_unavailable("cpu") is None else ())


def packed(arch: str, scheme: str):
    model = hamburger(arch, k=4)
    model.attach_merger(random_merger(model.base, channels=arch == "qwen2"))
    quantize_model(model.base, scheme)
    return model


class Counted:
    """A fast layer that counts its calls."""

    def __init__(self, layer: FastLayer, count: list[int]) -> None:
        self.layer, self.count = layer, count

    def usable(self) -> bool:
        return self.layer.usable()

    def __call__(self, *args):
        self.count[0] += 1
        return self.layer(*args)


def calls(engine: Engine) -> list[int]:
    """Counts the engine's fast layers' calls from now on (one counter for all of them)."""
    count = [0]
    engine.fast = [Counted(f, count) for f in engine.fast]
    return count


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_fast_layers_decode_the_same_tokens_in_every_mode(arch, scheme):
    model = packed(arch, scheme)
    fast = Engine(model, draft_policy=False, native_layers=False)
    slow = Engine(model, draft_policy=False, fast_layers=False)
    assert fast.fast is not None and slow.fast is None
    for mode in ("verify", "trust", "compress"):
        kw = {"max_new_tokens": 16, "confidence": 0.05, "mode": mode, "eos_token_ids": set()}
        want = slow.generate(PROMPTS, **kw)
        got = fast.generate(PROMPTS, **kw)
        assert got.tokens == want.tokens and got.steps == want.steps, mode
    one = Engine(model, draft_policy=False, native_layers=False)
    count = calls(one)
    one.generate(PROMPTS[:1], max_new_tokens=4, mode="verify", eos_token_ids=set())
    assert count[0] >= 4 * len(model.base.model.layers)  # the prefill and the steps went through them


def test_one_layer_is_bit_for_bit_the_module_path_at_several_positions():
    from hamburger.inference.kv import KVCache, layer_forward
    model = packed("llama", "int4")
    base = model.base.model
    layer = FastLayer(base.layers[1], base.config)
    x = torch.randn(2, 5, base.config.hidden_size)
    positions = torch.arange(4, 9)[None].expand(2, -1)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)
    mask[1, ..., :2] = False  # the second row's first two slots are padding
    caches = [KVCache.for_layers(base.layers, base.config, 2, 12, torch.float32, "cpu") for _ in range(2)]
    with torch.inference_mode():
        rope = base.rotary_emb(x, positions)
        want = layer_forward(base.layers[1], x, rope, caches[0], 1, 4, mask)
        got = layer(x, *rope_tables(rope), caches[1], 1, 4, mask)
    assert torch.equal(got, want) and torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_not_used_where_it_would_not_be_the_same_computation():
    float_model = hamburger("llama", k=4)  # float layers: q/k/v are not fused, nothing to serve from one output
    assert decode_layers(float_model.base.model) is None
    unfused = hamburger("llama", k=4)
    quantize_model(unfused.base, "int4", fuse=False)
    assert decode_layers(unfused.base.model) is None
    half = hamburger("llama", k=4)
    quantize_model(half.base, "int4")
    half.base.model.layers[-1].post_attention_layernorm.to(torch.bfloat16)  # not float32 (any layer's norm):
    assert decode_layers(half.base.model) is None  # torch.rms_norm would round otherwise


def test_a_hook_or_a_swapped_module_sends_the_pass_back_to_the_module_path():
    model = packed("llama", "int4")
    engine = Engine(model, draft_policy=False, native_layers=False)
    count = calls(engine)
    want = Engine(model, draft_policy=False, fast_layers=False).generate(PROMPTS, max_new_tokens=8, mode="verify",
                                                                          eos_token_ids=set())
    seen = []
    handle = model.base.model.layers[2].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(1))
    got = engine.generate(PROMPTS, max_new_tokens=8, mode="verify", eos_token_ids=set())
    assert count[0] == 0 and seen  # the hooked module ran, through the module path
    assert got.tokens == want.tokens
    handle.remove()
    engine.generate(PROMPTS, max_new_tokens=8, mode="verify", eos_token_ids=set())
    assert count[0] > 0
    mlp = model.base.model.layers[0].mlp
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    assert not engine.fast[0].usable()


def test_greedy_tokens_are_argmax_ties_and_nans_included():
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 49152), (3, 5, 1000), (16, 7244), (2, 8, 300)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, generator=gen).to(dtype)
            tied = x.round()  # many equal maxima: the first one's index
            tied[..., 3] = tied[..., 7] = float("inf")
            nan = x.clone()
            nan[..., 5] = float("nan")
            for t in (x, tied, nan):
                assert torch.equal(greedy_tokens(t), t.argmax(-1)), (shape, dtype)


def test_a_checked_step_takes_token_0_from_its_check_pass_not_another_head(monkeypatch):
    """After a check pass every verify row's token 0 is the pass's own choice: one LM head fewer a pass than when
    the macro-step computes it again, the same text, the base's (batches mixing trust rows, whose token 0 needs
    the head: test_scheduler's mixed-mode tests)."""
    from conftest import base_greedy
    from hamburger.inference import verify
    model = hamburger("llama", k=4)
    heads = [0]
    lm_head = model.lm_head

    def counted(h):
        heads[0] += 1
        return lm_head(h)

    expected = base_greedy(model, PROMPTS[0], 20)

    def oracle(ids, histories, room):  # the base's own continuation, a third of the drafts spoiled
        noise = torch.Generator().manual_seed(len(histories[0]))
        drafts = expected[len(histories[0]): len(histories[0]) + min(room[0], 3)]
        return [[(t + 1) % 96 if bool(torch.rand(1, generator=noise) < 0.3) else t for t in drafts]]

    def run():
        heads[0] = 0
        engine = Engine(model, draft_policy=False, draft_rows=None, drafter=oracle)
        out = engine.generate(PROMPTS[:1], max_new_tokens=20, confidence=0.5, mode="verify", eos_token_ids=set())
        return out, heads[0]

    monkeypatch.setattr(model, "lm_head", counted)
    out, now = run()
    accept = verify.accept

    def accept_without_token_0(runner, rows, n, checked, final, width):
        at = accept(runner, rows, n, checked, final, width)
        rows.next_t0[:n] = -1
        return at

    monkeypatch.setattr(verify, "accept", accept_without_token_0)
    before, then = run()
    passes = out.stats.base_forwards - 1  # the prefill is one
    assert then - now == passes and passes < 12  # drafts were kept: fewer passes than tokens
    assert len(set(out.steps[0])) > 2  # passes kept 0, 1, 2 or 3 drafts: token 0 came from varied positions
    assert out.tokens == before.tokens and out.tokens[0] == expected
