"""The decoding modes as types (`inference/modes.py`): each name resolves to one `Mode`, whose fields say what the
code downstream does with it."""

from __future__ import annotations

import pytest

from hamburger.errors import HamburgerError
from hamburger.inference.admission import EntriesEstimate
from hamburger.inference.modes import BY_NAME, COMPRESS, TRUST, VERIFY, parse_mode
from hamburger.model.config import MODES


def test_every_name_parses_to_its_mode_and_a_mode_to_itself():
    assert tuple(BY_NAME) == MODES
    for mode in (TRUST, VERIFY, COMPRESS):
        assert parse_mode(mode.name) is mode and parse_mode(mode) is mode and str(mode) == mode.name


def test_an_unknown_name_is_refused():
    with pytest.raises(HamburgerError, match="mode must be one of trust, verify, compress"):
        parse_mode("bogus")


@pytest.mark.parametrize("mode, checked, merged, lookup, paced, per_token", [
    (TRUST, False, False, False, False, False),
    (VERIFY, True, False, True, True, True),
    (COMPRESS, True, True, True, False, False),
])
def test_what_each_mode_does(mode, checked, merged, lookup, paced, per_token):
    assert (mode.checked, mode.merged, mode.lookup, mode.paced, mode.per_token) == (checked, merged, lookup, paced,
                                                                                      per_token)
    assert mode.base_lora is not checked  # the checked modes check against the untouched base


def test_default_confidence_reads_the_checkpoint_field():
    class Config:
        default_confidence, verify_confidence = 0.6, 0.2

    class Model:
        config = Config()

    assert [m.default_confidence(Model()) for m in (TRUST, VERIFY, COMPRESS)] == [0.6, 0.2, 0.2]


def test_entries_estimate_takes_a_mode_or_its_name():
    est = EntriesEstimate(window=4)
    assert est.rate(COMPRESS) == est.rate("compress") == COMPRESS.entries_prior
    assert est.need(10, 20, VERIFY) == 30  # one entry per token
    assert est.need(10, 20, COMPRESS) == 10 + 4 + 12  # its window exact, then 0.75 per token (rounded up)
