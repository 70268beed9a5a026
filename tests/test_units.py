"""Pure helpers on tiny inputs with explicit expected outputs: embedder, stop rule, sampling, segmentation data."""

from __future__ import annotations

import math

import pytest
import torch

from hamburger import (
    GenerationStats,
    HamburgerError,
    SamplingParams,
    SegmentedExample,
    collate,
)
from hamburger.inference.sampling import continues, sample
from hamburger.model.embedder import CompositionalEmbedder
from hamburger.training.data import step_positions


def logit_for(p_continue: float) -> float:
    """The stop logit whose P(continue) = sigmoid(-logit) is p_continue."""
    return -math.log(p_continue / (1 - p_continue))


@pytest.mark.parametrize("p,confidence,expected", [
    (0.9, 0.8, True), (0.81, 0.8, True), (0.79, 0.8, False), (0.5, 0.8, False),
    (0.6, 0.5, True), (0.4, 0.5, False), (0.95, 0.9, True), (0.85, 0.9, False),
    (0.999999, 1.0, False),
])
def test_stop_rule_with_hand_set_logits(p, confidence, expected):
    assert continues(torch.tensor([logit_for(p)]), confidence).item() is expected


def test_confidence_one_never_continues_even_when_sigmoid_saturates():
    assert not continues(torch.tensor([-1e4, -50.0, -17.0]), 1.0).any()
    assert continues(torch.tensor([-1e4, -50.0, -17.0]), 0.999).all()


def test_lower_confidence_continues_more():
    logits = torch.linspace(-4, 4, 101)
    counts = [int(continues(logits, c).sum()) for c in (0.5, 0.6, 0.7, 0.8, 0.9)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_confidence_per_sequence():
    logits = torch.tensor([logit_for(0.7), logit_for(0.7)])
    assert continues(logits, torch.tensor([0.5, 0.9])).tolist() == [True, False]


def test_greedy_and_filtered_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    assert sample(logits, SamplingParams()).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(200)])
    assert set(draws[:, 0].tolist()) <= {1, 3} and set(draws[:, 1].tolist()) <= {0, 3}
    assert len(set(draws[:, 1].tolist())) == 2
    nucleus = torch.stack([sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(100)])
    assert set(nucleus[:, 0].tolist()) == {1}


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.5, 40, 0.3),
                                                     (1.0, 1, 0.99), (2.0, 300, 0.05)])
def test_warpers_equal_transformers_logits_warpers(temperature, top_k, top_p):
    """Our warpers (no transformers import on the generate path) give transformers' scores bit for bit, ties and
    rows with one dominant token included."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 257, generator=gen) * 3
    logits[1, :100] = logits[1, 0]  # ties at the cut
    logits[2, 3] = 60.0  # one token holds all the mass
    theirs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        theirs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        theirs.append(TopPLogitsWarper(top_p))
    ours = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).warpers()
    assert torch.equal(ours(logits), theirs(None, logits))


def test_embedder_single_token_step_is_the_plain_embedding():
    emb = CompositionalEmbedder(16, 2, 4, 8)
    torch.nn.init.normal_(emb.o_proj.weight)
    x = torch.randn(3, 4, 16)
    out = emb(x, torch.tensor([1, 1, 1]))
    assert torch.equal(out, x[:, 0])


def test_embedder_starts_as_mean_pooling_and_ignores_padding():
    emb = CompositionalEmbedder(16, 2, 4, 8)
    x = torch.randn(2, 4, 16)
    out = emb(x, torch.tensor([3, 2]))
    torch.testing.assert_close(out, torch.stack([x[0, :3].mean(0), x[1, :2].mean(0)]))
    torch.nn.init.normal_(emb.o_proj.weight)
    y = x.clone()
    y[0, 3] = 100.0  # padding beyond the step's length
    torch.testing.assert_close(emb(x, torch.tensor([3, 2])), emb(y, torch.tensor([3, 2])))


def test_embedder_is_order_aware():
    emb = CompositionalEmbedder(16, 2, 4, 8)
    torch.nn.init.normal_(emb.o_proj.weight)
    x = torch.randn(1, 2, 16)
    swapped = x.flip(1)
    assert not torch.allclose(emb(x, torch.tensor([2])), emb(swapped, torch.tensor([2])))


def test_step_positions_are_last_token_indices():
    # prompt of 5 tokens (0..4); steps of 2, 3, 1 cover tokens 5-6, 7-9, 10
    assert step_positions(5, [2, 3, 1]) == [6, 9, 10]


def test_collate_builds_slots_and_step_targets():
    example = SegmentedExample([10, 11, 12, 20, 21, 22, 23, 24], 3, [2, 3])
    batch = collate([example], 4, 0)
    assert example.num_slots == batch.slot_tokens.shape[1] == 4  # what length bucketing sorts by
    assert batch.slot_tokens[0, :, :].tolist() == [[10, 0, 0, 0], [11, 0, 0, 0], [12, 0, 0, 0], [20, 21, 0, 0]]
    assert batch.slot_lengths[0].tolist() == [1, 1, 1, 2]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 4]
    assert batch.step_slot.tolist() == [2, 3]
    assert batch.step_tokens.tolist() == [[20, 21, 0, 0], [22, 23, 24, 0]]
    assert batch.step_lengths.tolist() == [2, 3]


@pytest.mark.parametrize("example", [
    SegmentedExample([1, 2, 3], 3, []),
    SegmentedExample([1, 2, 3, 4], 2, [1]),
    SegmentedExample([1, 2, 3, 4, 5, 6, 7, 8], 2, [6]),
    SegmentedExample([1, 2, 3], 0, [3]),
])
def test_collate_rejects_bad_segmentation(example):
    with pytest.raises(HamburgerError):
        collate([example], 4, 0)


def test_stats_definitions():
    st = GenerationStats(sequences=2, prompt_tokens=30, generated_tokens=42, macro_steps=20, micro_steps=22,
                         base_forwards=11, prefill_s=0.5, decode_s=2.0)
    assert st.tokens_per_step == 2.1
    assert st.kv_entries == 50 and st.kv_entries_base == 72
    assert st.decode_tokens_per_s == 20.0  # (42 - 2 first tokens) / 2 s
    assert st.to_dict()["tokens_per_step"] == 2.1
    assert GenerationStats().tokens_per_step == 0.0 and GenerationStats().decode_tokens_per_s == 0.0
