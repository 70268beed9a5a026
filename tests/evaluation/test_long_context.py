"""The long-context tasks: haystacks from Python's own documentation, a planted password, ROUGE-L."""

from __future__ import annotations

from hamburger.evaluation.long_context import LENGTHS, found, long_items, plant, rouge_l


def test_needle_items_plant_one_password_in_a_haystack_of_the_given_length():
    items = long_items("needle", 6)
    assert [i.id for i in items] == [i.id for i in long_items("needle", 6)]  # seeded: the same every run
    assert [i.answer for i in items] == [i.answer for i in long_items("needle", 6)]
    for n, item in enumerate(items):
        text = item.messages[0]["content"]
        assert text.count(f"The secret password is {item.answer}.") == 1
        assert abs(item.meta["chars"] - LENGTHS[n % len(LENGTHS)]) < 200
        assert text.endswith("Reply with the password only.")
    assert len({i.messages[0]["content"] for i in items}) == 6


def test_plant_puts_the_sentence_at_a_paragraph_break_near_the_depth():
    text = "\n\n".join(f"paragraph {i}" for i in range(10))
    planted = plant(text, "NEEDLE.", 0.5)
    parts = planted.split("\n\n")
    assert "NEEDLE." in parts and 3 <= parts.index("NEEDLE.") <= 6


def test_found_and_rouge_l():
    assert found("The password is Amber.", "amber") and not found("ambers everywhere", "amber")
    assert not found("anything", None)
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == 2 / 3  # LCS the cat on mat: 4 of 6 each
    assert rouge_l("", "words") == 0.0 and rouge_l("", "") == 1.0
