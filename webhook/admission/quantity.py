"""Parsing of Kubernetes resource quantities ("8000", "1k", "500m", "2Gi", "1e3") into exact numbers.

The grammar is Kubernetes' own (``k8s.io/apimachinery/pkg/api/resource``): a signed decimal
number followed by a binary-SI suffix (Ki..Ei), a decimal-SI suffix (n, u, m, k, M..E) or a
decimal exponent (``e3``). Results are :class:`fractions.Fraction` so "0.5" and "500m" stay
exact and the caller decides what is whole. Manifests read from YAML may carry plain ints or
floats; both are accepted. Absurd inputs (very long strings, huge exponents) are refused rather
than computed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUMBER = re.compile(
    r"^(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?$"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_MAX_TEXT = 64
_MAX_EXPONENT = 64


class QuantityError(ValueError):
    """The value is not a Kubernetes quantity; the message says what was wrong."""


def parse_quantity(value: object) -> Fraction:
    """Return the exact value of a quantity given as a string, an int or a float."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a quantity")
        return Fraction(repr(value))
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity")
    text = value.strip()
    if not text or len(text) > _MAX_TEXT:
        raise QuantityError(f"{value!r} is not a quantity")
    match = _NUMBER.match(text)
    if match is None or not (match["int"] or match["frac"]):
        raise QuantityError(f"{value!r} is not a quantity (examples: 8000, 1k, 500m)")
    number = Fraction(int(match["int"] or "0"))
    if match["frac"]:
        number += Fraction(int(match["frac"]), 10 ** len(match["frac"]))
    suffix, exp = match["suffix"], match["exp"]
    if suffix in _BINARY:
        number *= 1024 ** _BINARY[suffix]
    elif suffix:
        number *= Fraction(10) ** _DECIMAL[suffix]
    elif exp is not None:
        power = int(exp)
        if abs(power) > _MAX_EXPONENT:
            raise QuantityError(f"{value!r}: exponent out of range")
        number *= Fraction(10) ** power
    return -number if match["sign"] == "-" else number
