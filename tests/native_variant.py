"""Which native variant a native test runs on, shared by tests/kernels/test_native.py and
tests/inference/test_native_layers.py: import `every_variant`, `pytest_generate_tests` and the `variant` fixture.

Every test runs on this CPU's best variant; those marked `@every_variant` also on each other variant it runs (an
AVX-512 machine: avx512-vnni, avx2-vnni, avx2). test_native_variants.py shows every variant gives the best's bits on
a broad set of cases, so the rest runs once, and a few representative tests check each variant against PyTorch."""

from __future__ import annotations

import pytest

from hamburger.kernels import native


def every_variant(test):
    test.every_variant = True
    return test


def pytest_generate_tests(metafunc):
    names = native.variants() or [None]
    metafunc.parametrize("variant", names if getattr(metafunc.function, "every_variant", False) else names[:1],
                         indirect=True)


@pytest.fixture(autouse=True)
def variant(request):
    """The variant a test runs on (`pytest_generate_tests`)."""
    if request.param is None:
        yield None
        return
    with native.using(request.param):
        if native.why_unavailable() is not None:
            pytest.skip(f"native kernels {request.param}: {native.why_unavailable()}")
        yield request.param
