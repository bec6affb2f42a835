"""Kubernetes quantity parsing: exact values for every suffix form, clear errors otherwise."""

from __future__ import annotations

from fractions import Fraction

import pytest

from webhook.admission.quantity import QuantityError, parse_quantity


@pytest.mark.parametrize(("text", "value"), [
    ("8000", 8000), ("+8", 8), ("-3", -3), ("0", 0), ("007", 7),
    ("1k", 1000), ("2M", 2_000_000), ("1G", 10**9), ("1T", 10**12), ("1P", 10**15),
    ("1E", 10**18), ("1Ki", 1024), ("1Mi", 1024**2), ("16Gi", 16 * 1024**3), ("1Ti", 1024**4),
    ("1Pi", 1024**5), ("1Ei", 1024**6),
    ("500m", Fraction(1, 2)), ("1500m", Fraction(3, 2)), ("250u", Fraction(1, 4000)),
    ("5n", Fraction(5, 10**9)),
    ("1e3", 1000), ("1E3", 1000), ("12e-1", Fraction(6, 5)), ("2e+0", 2),
    ("0.5", Fraction(1, 2)), (".5", Fraction(1, 2)), ("1.", 1), ("1.25Ki", 1280),
    (" 42 ", 42), (8000, 8000), (1.0, 1), (0.25, Fraction(1, 4)),
    # the limits, reached and not passed: 64 characters, an exponent of 64 either way
    ("1" * 64, int("1" * 64)), ("1e64", 10**64), ("1e-64", Fraction(1, 10**64)),
])
def test_quantity_parses_to_its_exact_value(text: object, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", [
    "", " ", "lots", "1 k", "1kb", "1KI", "Mi", ".", "+", "1.2.3", "--1", "1e", "e3", "1e3Mi",
    "0x10", "1_000", "１２", "1" * 65, "1e999", "1e65", "1e-65", True, None, [], {}, float("nan"), float("inf"),
])
def test_non_quantity_is_refused_with_a_message(text: object) -> None:
    with pytest.raises(QuantityError) as info:
        parse_quantity(text)
    assert "quantity" in str(info.value) or "exponent" in str(info.value)
