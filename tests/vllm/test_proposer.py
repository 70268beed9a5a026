"""`hamburger.vllm` without vLLM: the lookup proposer on the arrays vLLM hands it, the speculative config, the
command line it starts, the metrics it reads. (Runs everywhere; `test_in_vllm.py` runs vLLM itself where installed.)"""

from __future__ import annotations

import importlib.util
import json
import shlex
from types import SimpleNamespace

import numpy as np
import pytest

from hamburger.errors import HamburgerError
from hamburger.model.files import read_safetensors
from hamburger.model.hamburger_model import REPLIES_NAME, packaged_checkpoint
from hamburger.vllm import LOOKUP_PROPOSER
from hamburger.vllm.launch import cpu_build, serve_argv, speculative_config, vllm_installed
from hamburger.vllm.offline import since, spec_metrics
from hamburger.vllm.proposer import LookupDrafts

DEFAULT_FOLDER = "/cache/hamburger/SmolLM2-135M-Instruct-0.1.2-98362432"


def config(k: int = 4, max_len: int = 64, model: str = "/models/tiny", extra: dict | None = None, vocab: int = 49152):
    """The parts of vLLM's `VllmConfig` the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len, model=model, get_vocab_size=lambda: vocab),
        additional_config=extra if extra is not None else {})


def batch(histories: list[list[int]], width: int = 64) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) as vLLM passes them: a row per request, padded."""
    tokens = np.zeros((len(histories), width), dtype=np.int32)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = h
    sampled = [[h[-1]] if h else [] for h in histories]
    return sampled, np.array([len(h) for h in histories], dtype=np.int32), tokens


def test_drafts_are_what_followed_the_last_tokens_earlier():
    drafts = LookupDrafts(config())
    drafts.load_model(object())  # vLLM's CPU runner calls it with the target model
    assert drafts.propose(*batch([[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 6]])) == [[4, 5, 1, 2], []]


def test_a_row_that_another_request_takes_over_drafts_from_its_own_tokens():
    drafts = LookupDrafts(config())
    assert drafts.propose(*batch([[7, 8, 9, 7, 8]])) == [[9, 7, 8]]
    # vLLM moved another request into row 0: none of the first request's n-grams may draft for it
    assert drafts.propose(*batch([[5, 6, 1, 5, 6]])) == [[1, 5, 6]]
    assert drafts.propose(*batch([[7, 8, 2, 7]])) == [[]]  # (7,) alone is shorter than the shortest n-gram


def test_growing_rows_draft_as_a_fresh_proposer_would():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, size=60).tolist()  # a small alphabet: many repeats
    kept = LookupDrafts(config(max_len=128))
    for n in range(3, 60, 3):
        rows = batch([seq[:n], seq[5 : n + 5]], width=128)
        assert kept.propose(*rows) == LookupDrafts(config(max_len=128)).propose(*rows), n


def test_rows_not_decoding_and_rows_at_their_length_get_no_drafts():
    drafts = LookupDrafts(config(max_len=10))
    sampled, n, tokens = batch([[1, 2, 3, 1, 2], [1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 4, 5, 6, 7, 1, 2]], width=10)
    sampled[0] = []  # row 0 sampled nothing this step (a prefill in chunks)
    # row 1: room for one draft below max_model_len (and the token the check adds); row 2: none
    assert drafts.propose(sampled, n, tokens) == [[], [3], []]


def test_the_checkpoints_stored_replies_draft_where_the_row_offers_nothing():
    store = read_safetensors(packaged_checkpoint() / REPLIES_NAME)["tokens"].tolist()
    at = next(i for i in range(100, len(store)) if min(store[i - 3 : i + 4]) >= 0)
    history = [49000, 49001] + store[at - 3 : at]  # the row's own tokens never repeat
    default = LookupDrafts(config(model=DEFAULT_FOLDER))
    found = default.propose(*batch([history]))[0]
    assert found and len(found) <= 4
    # what the store holds after those tokens somewhere (its latest occurrence), checked against the store itself
    assert any(store[j - 3 : j] == history[-3:] and store[j : j + len(found)] == found for j in range(3, len(store)))
    assert LookupDrafts(config(model=DEFAULT_FOLDER, extra={"hamburger": {"checkpoint": "none"}})).propose(
        *batch([history])) == [[]]
    assert LookupDrafts(config(model="/models/another")).propose(*batch([history])) == [[]]  # another base's vocab


def test_drafts_outside_the_served_vocabulary_are_dropped():
    # (1, 60) was last followed by 3, 1, 60: the draft ends before 60, which the served model cannot take
    assert LookupDrafts(config(vocab=50)).propose(*batch([[1, 60, 2, 1, 60, 3, 1, 60]])) == [[3, 1]]
    assert LookupDrafts(config(vocab=50)).propose(*batch([[1, 2, 60, 4, 1, 2]])) == [[]]


def test_settings_are_checked():
    with pytest.raises(HamburgerError, match="not a HAMburger checkpoint"):
        LookupDrafts(config(extra={"hamburger": {"checkpoint": "/no/such/folder"}}))
    with pytest.raises(HamburgerError, match="must be an object"):
        LookupDrafts(config(extra={"hamburger": 3}))
    assert LookupDrafts(config(extra={"hamburger": {"lookup": 3}})).min_ngram == 3


def test_speculative_configs_name_the_proposer_and_vllms_own_methods():
    assert speculative_config("lookup", 3) == {"method": "custom_class", "model": LOOKUP_PROPOSER,
                                                "num_speculative_tokens": 3}
    assert speculative_config("ngram")["method"] == "ngram"
    assert speculative_config("none") is None
    with pytest.raises(HamburgerError):
        speculative_config("eagle")
    assert importlib.util.find_spec(LOOKUP_PROPOSER.rsplit(".", 1)[0]) is not None


def test_hamburger_vllm_command_prints_the_vllm_serve_line(capsys, tmp_path):
    from hamburger.cli import main

    assert main(["vllm", "command", "--model", str(tmp_path), "--port", "9123",
                 "--vllm-args", "--max-model-len 256 --enforce-eager"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[argv.index("serve") + 1] == str(tmp_path)
    assert argv[argv.index("--port") + 1] == "9123" and argv[-3:] == ["--max-model-len", "256", "--enforce-eager"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == speculative_config("lookup")
    assert argv == serve_argv(str(tmp_path), port=9123, extra=["--max-model-len", "256", "--enforce-eager"],
                              cpu=cpu_build())
    assert main(["vllm", "command", "--model", str(tmp_path), "--drafts", "micro", "--micro-min-prob", "0.3",
                 "--checkpoint", "/ckpt"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"hamburger": {"checkpoint": "/ckpt",
                                                                                     "min_prob": 0.3}}
    assert "--enforce-eager" in argv and json.loads(argv[argv.index("--speculative-config") + 1])["model"] == (
        "hamburger.vllm.micro.MicroDrafts")


def test_vllms_cpu_build_gets_a_memory_share_and_a_kv_cache_unless_told():
    """vLLM's CPU build reserves 0.92 of the machine's memory by default (it fails beside other processes) and keeps
    as KV cache what is left of its share: `hamburger vllm serve` gives it `CPU_MEMORY_ARGS`, unless the user's
    arguments set either."""
    from hamburger.vllm.launch import CPU_MEMORY_ARGS

    argv = serve_argv("/m", cpu=True, extra=["--max-model-len", "256"])
    assert argv[-len(CPU_MEMORY_ARGS) - 2 : -2] == CPU_MEMORY_ARGS and argv[-2:] == ["--max-model-len", "256"]
    assert not set(CPU_MEMORY_ARGS) & set(serve_argv("/m"))  # another build (CUDA): vLLM's own defaults
    for told in (["--gpu-memory-utilization", "0.3"], ["--kv-cache-memory-bytes=2000000000"]):
        argv = serve_argv("/m", cpu=True, extra=told)
        assert argv[-len(told):] == told and argv.count(told[0]) == 1 and "0.1" not in argv


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
def test_hamburger_vllm_serve_without_vllm_says_so_in_one_line(capsys):
    from hamburger.cli import main

    assert main(["vllm", "serve", "--model", "/models/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM is not installed" in err and "hamburger[vllm]" in err


def test_spec_metrics_read_vllms_counters():
    def snapshot(drafts, accepted, per):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=4 * drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per),
                SimpleNamespace(name="vllm:num_requests_running", value=1)]

    before, after = spec_metrics(snapshot(2, 3, [2, 1, 0, 0])), spec_metrics(snapshot(10, 13, [8, 4, 1, 0]))
    assert before["mean_acceptance_length"] == 2.5
    run = since(after, before)
    assert (run["drafts"], run["accepted"], run["per_position"]) == (8, 10, [6, 3, 1, 0])
    assert run["mean_acceptance_length"] == 1 + 10 / 8 and run["per_position_rate"] == [6 / 8, 3 / 8, 1 / 8, 0]
    assert spec_metrics([])["mean_acceptance_length"] is None


def test_context_rows_keep_the_latest_kept_entries_and_follow_a_request_that_moves():
    import torch

    from hamburger.vllm.micro import ContextRows

    ctx = ContextRows(window=3)
    ctx.begin()
    kv = lambda ps: (torch.tensor([[float(p) for p in ps]]), -torch.tensor([[float(p) for p in ps]]))  # noqa: E731
    first = np.array([1, 2, 3, 4, 5, 6])
    entries = ctx.entries(0, first)
    ctx.admit(entries, [0, 1, 2, 3, 4], *kv([0, 1, 2, 3, 4]), upto=4)  # a prompt's prefill: the latest 3 stay
    assert sorted(entries) == [2, 3, 4] and float(entries[4][0][0]) == 4.0 and float(entries[4][1][0]) == -4.0
    grown = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    ctx.begin()
    entries = ctx.entries(0, grown)
    ctx.admit(entries, [5, 6, 7, 8], *kv([5, 6, 7, 8]), upto=6)  # two drafts rejected: positions 7 and 8 stay out
    assert sorted(entries) == [4, 5, 6]
    ctx.begin()
    assert ctx.entries(0, np.array([9, 9, 9])) == {}  # another request took row 0 ...
    assert sorted(ctx.entries(1, np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]))) == [4, 5, 6]  # ... the first one is in row 1
    ctx.begin()
    assert ctx.entries(0, np.array([1, 2, 3])) == {}  # a history that is not an extension claims nothing


def test_micro_drafts_refuse_a_base_without_its_checkpoint():
    """The micro-step decoder drafts for its own base only: vLLM serving another model, with no checkpoint named,
    is refused at start (it would otherwise draft from the packaged decoder for a base it was not trained on)."""
    from hamburger.vllm.micro import MicroDrafts

    with pytest.raises(HamburgerError, match="checkpoint of the base vLLM serves"):
        MicroDrafts(config(model="/models/another-base"))
    with pytest.raises(HamburgerError, match="checkpoint of the base vLLM serves"):
        MicroDrafts(config(model=DEFAULT_FOLDER, extra={"hamburger": {"checkpoint": "none"}}))


def test_micro_drafts_of_a_row_do_not_depend_on_the_other_rows():
    """`MicroDrafts.micro_drafts` runs every row's micro-steps as one batch (context entries padded to the longest
    and masked): each row's drafts equal those it gets alone, whatever the other rows' contexts, counts and
    `min_prob` stops."""
    import torch
    from conftest import hamburger

    from hamburger.vllm.micro import MicroDrafts

    ham = hamburger("llama", k=4, micro_context=6).eval()
    cfg = ham.base.config
    drafts = MicroDrafts.__new__(MicroDrafts)  # the proposer without vLLM's config: the parts micro_drafts reads
    drafts.ham, drafts.vocab, drafts.min_prob = ham, cfg.vocab_size, 0.0
    drafts.kv_heads, drafts.head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    drafts.shortlist(ham)  # no shortlist: the whole head
    g = torch.Generator().manual_seed(0)
    n_ctx, d, width = len(ham.micro.context_layers), cfg.hidden_size, drafts.kv_heads * drafts.head_dim

    def job(t: int, pos: int, count: int, t0: int):
        feats = torch.randn(len(ham.micro.feature_layers), d, generator=g)
        entries = {pos - t + 1 + i: (torch.randn(n_ctx, width, generator=g), torch.randn(n_ctx, width, generator=g))
                   for i in range(t)}
        return feats, t0, entries, pos, count

    jobs = [job(6, 20, 3, 5), job(1, 7, 2, 40), job(3, 11, 3, 9), job(5, 30, 1, 77)]
    with torch.inference_mode():
        together = drafts.micro_drafts(jobs)
        alone = [drafts.micro_drafts([j])[0] for j in jobs]
        assert together == alone and [len(x) for x in together] == [3, 2, 3, 1]
        drafts.min_prob = 0.2  # rows stop early, each at its own first unlikely token
        stopped = drafts.micro_drafts(jobs)
        assert stopped == [drafts.micro_drafts([j])[0] for j in jobs] and stopped != together and any(stopped)
        drafts.min_prob = 0.0
        ham.micro_vocab = torch.arange(0, cfg.vocab_size, 2)  # a shortlist: drafts are its tokens, as vocabulary ids
        drafts.shortlist(ham)
        short = drafts.micro_drafts(jobs)
        assert short == [drafts.micro_drafts([j])[0] for j in jobs] and all(t % 2 == 0 for d in short for t in d)
        assert [len(x) for x in short] == [3, 2, 3, 1]
    assert drafts.micro_drafts([]) == []


def test_micro_draft_rows_setting():
    """The micro-step decoder drafts while at most `draft_rows` rows decode: DRAFT_ROWS on a CPU by default (as the
    engine's verify mode), always on other devices, or what the setting says; a bad value is refused."""
    from hamburger.model.config import DRAFT_ROWS
    from hamburger.vllm.micro import micro_draft_rows

    assert micro_draft_rows("auto", "cpu") == DRAFT_ROWS and micro_draft_rows("auto", "cuda") is None
    assert micro_draft_rows(8, "cpu") == 8 and micro_draft_rows(0, "cuda") == 0 and micro_draft_rows(None, "cpu") is None
    for bad in (-1, "many", True, 2.5):
        with pytest.raises(HamburgerError, match="hamburger.draft_rows"):
            micro_draft_rows(bad, "cpu")
