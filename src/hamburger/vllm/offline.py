"""vLLM's offline `LLM.generate` with HAMburger's drafts, and what its SpecDecoding metrics say.

`run` builds one `vllm.LLM` (plain, with vLLM's n-gram drafts, or with HAMburger's lookup drafts), decodes chat
prompts greedily (at batch 1: one after another; else all at once, at most `concurrency` together), and returns
each reply's token ids, the time, and vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens
and accepted tokens per draft position. The mean acceptance length is vLLM's own definition,
1 + accepted tokens / drafts (the tokens one target forward emits per drafting step).

`python -m hamburger.vllm.offline '{json}'` runs `run(**json)` in a process of its own and prints its result as one
JSON line (the tests and `benchmarks/vllm_drafts.py` compare configurations, each in a fresh process).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from hamburger.model.base import encode_chat
from hamburger.vllm.launch import hf_folder, require_vllm, speculative_config

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def spec_metrics(metrics: list) -> dict[str, Any]:
    """vLLM's SpecDecoding counters from `LLM.get_metrics()`: drafts, draft_tokens, accepted, per_position
    (accepted tokens at each draft position), mean_acceptance_length and per_position_rate (accepted / drafts)."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in m.values]
            per = out["per_position"]
            out["per_position"] = [a + b for a, b in zip(per + [0] * len(values), values + [0] * len(per))]
    return with_rates(out)


def with_rates(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with mean_acceptance_length (1 + accepted / drafts) and per_position_rate (accepted / drafts)."""
    drafts = spec["drafts"]
    spec["mean_acceptance_length"] = 1 + spec["accepted"] / drafts if drafts else None
    spec["per_position_rate"] = [a / drafts for a in spec["per_position"]] if drafts else []
    return spec


def since(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The counters gathered between two `spec_metrics` snapshots."""
    spec = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    was = before["per_position"] + [0] * len(after["per_position"])
    spec["per_position"] = [a - b for a, b in zip(after["per_position"], was)]
    return with_rates(spec)


def build(model: str | None = None, drafts: str = "none", num_drafts: int = 4, concurrency: int = 1,
          max_model_len: int = 2048, dtype: str = "float32", settings: dict | None = None, memory: float = 0.15,
          kv_bytes: int = 1 << 30):
    """A `vllm.LLM` on `model` (default: the embedded default's folder) with `drafts` ("none", "ngram", "suffix",
    "lookup"). `memory`: vLLM's gpu_memory_utilization, on its CPU backend the share of the machine's memory it
    reserves (its default, 0.92, fails beside other processes). `kv_bytes`: its KV cache, set apart from that share:
    sized by the share, the cache is what is left of it after the process's own memory, and with the micro-step
    decoder loaded beside the model nothing was left on a machine whose memory node holds 12.7 GiB (2026-11-28).
    `settings`: the proposer's (`proposer.settings`)."""
    require_vllm()
    from vllm import LLM

    extra = {"hamburger": settings} if settings else {}
    return LLM(hf_folder(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max(concurrency, 1),
               speculative_config=speculative_config(drafts, num_drafts), additional_config=extra,
               disable_log_stats=False, enforce_eager=True, seed=0, gpu_memory_utilization=memory,
               kv_cache_memory_bytes=kv_bytes)


def run(prompts: list[list[dict[str, str]]], drafts: str = "none", max_tokens: int = 128, concurrency: int = 1,
        model: str | None = None, num_drafts: int = 4, dtype: str = "float32", settings: dict | None = None,
        warmup: bool = True) -> dict[str, Any]:
    """Greedy replies to chat `prompts` through vLLM: tokens (per prompt), seconds, tokens_per_s, spec metrics."""
    require_vllm()  # before vLLM's first import (`launch.shield_vision`)
    from vllm import SamplingParams

    llm = build(model, drafts, num_drafts, concurrency, dtype=dtype, settings=settings)
    tokenizer = llm.get_tokenizer()
    ids = [{"prompt_token_ids": encode_chat(tokenizer, m)} for m in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    if warmup:
        llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = spec_metrics(llm.get_metrics())
    start = time.perf_counter()
    if concurrency <= 1:
        outs = [o for p in ids for o in llm.generate([p], params, use_tqdm=False)]
    else:
        outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = spec_metrics(llm.get_metrics())
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    spec = since(after, before)
    generated = sum(len(t) for t in tokens)
    return {"drafts": drafts, "concurrency": concurrency, "tokens": tokens, "generated": generated,
            "seconds": seconds, "tokens_per_s": generated / seconds, "spec": spec}


def main(argv: list[str] | None = None) -> None:
    args = json.loads((argv if argv is not None else sys.argv[1:])[0])
    print("HAMBURGER_RESULT " + json.dumps(run(**args)), flush=True)


if __name__ == "__main__":
    main()
