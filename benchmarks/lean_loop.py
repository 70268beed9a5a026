"""What the decode loop's glue costs at batch 1: the engine's base beside a lean greedy loop on the same native calls.

The lean loop is the least Python a batch-1 greedy base step can have on today's native calls: the token's embedding
row, one `NativeLayers.run` over the decoder layers at the next slot, which runs the final norm and the LM head's
argmax too (as the engine's lone step does); host integers for the position and the token, nothing else. The engine's base (`Engine` on
`HamburgerModel.plain`, the scheduler's step: rows, limits, the macro-step, events) decodes the same prompts; both
must give the same tokens (EOS ignored, so both run the full length). Prompts alternate between the two, whichever
goes first rotating per round. The difference per token is what the engine's bookkeeping around the same native
work costs: what a batch-1 fast path could win (issue 51's "Python per step"). Not a user-facing path.

    python benchmarks/lean_loop.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import time

import torch

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.inference.native_layers import ARGMAX, final_norm
from hamburger.kernels.qbase import native_head
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel


def lean(runner, emb: torch.Tensor, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens after `prompt`, and the seconds after the first (the bench's decode time)."""
    base, p = runner.base, len(prompt)
    cache = KVCache.for_layers(base.layers, base.config, 1, p + n + 1, runner.kv_dtype, runner.device)
    h = runner.prefill([prompt], cache, torch.tensor([0]))[:, 0]
    visible = torch.ones(1, 1, 1, p + n + 1, dtype=torch.bool)
    depth, out, start = len(base.layers), [], 0.0
    norm, head = final_norm(base), native_head(runner.model.base.get_output_embeddings(), h)
    tok = int(runner.head_argmax(h)[0])
    for i in range(n):
        out.append(tok)
        if i == 0:
            start = time.perf_counter()
        if i == n - 1:
            break
        pos = p + i
        x = emb[tok].view(1, 1, -1).clone()
        xs = runner.native.run(x, runner.rope(torch.tensor([[pos]])), cache, pos, visible[..., : pos + 1], [depth],
                               norm=norm, last=True, head=head)
        tok = int(xs[ARGMAX][0])
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="code,math,chat", help=f"prompt sets, from {', '.join(SETS)}")
    ap.add_argument("--prompts-per-set", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model, _ = load("default", quantize="auto", decode_only=True)
    engine = Engine(HamburgerModel.plain(model.base, model.tokenizer))
    runner = engine.runner
    if runner.native is None:
        raise SystemExit("the native layers do not run here: nothing to compare")
    emb = model.base.get_input_embeddings().weight
    prompts = [encode_chat(model.tokenizer, m) for s in a.sets.split(",") for m in bench_messages(s, a.prompts_per_set)]
    n = a.max_new_tokens
    seconds, tokens, same = {"lean": 0.0, "engine": 0.0}, {"lean": 0, "engine": 0}, 0
    with torch.inference_mode():
        engine.generate([prompts[0]], max_new_tokens=16)
        lean(runner, emb, prompts[0], 16)
        for r in range(a.rounds):
            for i, prompt in enumerate(prompts):
                got = {}
                for name in (("lean", "engine") if (i + r) % 2 == 0 else ("engine", "lean")):
                    if name == "lean":
                        got[name], dt = lean(runner, emb, prompt, n)
                    else:
                        gen = engine.stream([prompt], max_new_tokens=n, eos_token_ids=set())
                        events = iter(gen)
                        next(events)  # the prefill's step
                        start = time.perf_counter()
                        for _ in events:
                            pass
                        dt, got[name] = time.perf_counter() - start, gen.output().tokens[0]
                    seconds[name] += dt
                    tokens[name] += len(got[name]) - 1
                same += got["lean"] == got["engine"]
    ms = {k: seconds[k] / tokens[k] * 1e3 for k in seconds}
    print(f"{len(prompts)} prompts ({a.sets}) x {a.rounds} rounds, {n} new tokens, batch 1, the default's base "
          f"(int4/int8), {torch.get_num_threads()} threads:\n")
    print("| loop | ms a token | tokens/s |\n| --- | ---: | ---: |")
    for k in ("engine", "lean"):
        print(f"| {k} | {ms[k]:.3f} | {1e3 / ms[k]:.1f} |")
    print(f"\nthe engine's glue: {ms['engine'] - ms['lean']:.3f} ms a token ({ms['engine'] / ms['lean']:.2f}x the lean "
          f"loop's time); the same tokens: {same}/{a.rounds * len(prompts)}")
    if same != a.rounds * len(prompts):
        raise SystemExit("the two loops gave different tokens")


if __name__ == "__main__":
    main()
