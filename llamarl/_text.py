"""Numbers as the text a verifier reads: positional decimals from the number's own shortest digits."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation


def decimal_text(value) -> str:
    """A finite real number (a Python or numpy float, or anything ``float()`` takes) as positional decimal text
    from its shortest round-trip digits, never scientific (which no verifier reads: "1e+21" would be the number 1
    followed by 21): 72.0 -> "72", 1e23 -> "100000000000000000000000", 1e-05 -> "0.00001", np.float32(72.1) ->
    "72.1" (its own digits, not the float64 widening 72.0999984741211)."""
    try:
        exact = Decimal(str(value))  # str: the shortest digits of the value's own type
    except InvalidOperation:
        exact = Decimal(repr(float(value)))
    return str(int(exact)) if exact == exact.to_integral_value() else format(exact, "f")
