# One-off probe of 2026-11-28 (HISTORY (18)); removed in the next commit. Run: python benchmarks/probes/demo_chat_reply.py
import time, torch
from hamburger.loading import load
from hamburger.inference.engine import Engine
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.model.base import encode_chat
from hamburger.evaluation.demo import PROMPTS
model, _ = load("default", quantize="auto", decode_only=True)
base = Engine(HamburgerModel.plain(model.base, model.tokenizer)); ham = Engine(model)
ids = encode_chat(model.tokenizer, [{"role": "user", "content": PROMPTS[2]}])
def run(eng, mode):
    gen = eng.stream([ids], max_new_tokens=256, mode=mode); it = iter(gen); next(it)
    a = time.perf_counter(); steps = sum(1 for _ in it); dt = time.perf_counter() - a
    out = gen.output(); return dt, out
with torch.inference_mode():
    for p in PROMPTS[:2]:
        i2 = encode_chat(model.tokenizer, [{"role": "user", "content": p}])
        base.generate([i2], max_new_tokens=256); ham.generate([i2], max_new_tokens=256, mode="verify")
    tb = tv = 0
    for r in range(10):
        db, ob = run(base, None); dv, ov = run(ham, "verify")
        tb += db; tv += dv
        s = ov.stats
        if r < 3: print(len(ov.tokens[0]), "tokens; steps", s.macro_steps, "drafted", s.drafted_tokens, "lookup", s.lookup_drafts, s.lookup_kept, "micro", s.micro_steps, f"base {db*1e3:.1f} ms verify {dv*1e3:.1f} ms", ov.steps[0])
    print(f"verify x base over 10: {tb/tv:.3f}")
