"""A deterministic keyword labeller: the offline model's answer and `/summary`'s fallback."""

from __future__ import annotations

import re

KEYWORDS: dict[str, tuple[str, ...]] = {
    "billing": (
        "invoice",
        "refund",
        "charge",
        "charged",
        "payment",
        "price",
        "bill",
        "billing",
        "subscription",
    ),
    "bug report": (
        "error",
        "bug",
        "crash",
        "crashes",
        "broken",
        "fails",
        "failed",
        "exception",
        "not working",
    ),
    "account access": ("login", "log in", "password", "account", "sign in", "locked", "2fa"),
    "shipping": ("delivery", "shipping", "package", "parcel", "tracking", "shipped", "courier"),
    "praise": ("love", "great", "thanks", "thank you", "excellent", "awesome"),
    "complaint": ("hate", "terrible", "awful", "worst", "disappointed", "angry"),
}


def keyword_label(text: str) -> tuple[str, int]:
    """The category whose keywords occur most often in `text` (ties: table order), with its
    number of hits; `("general", 0)` when none occurs."""
    lowered = " " + " ".join(re.findall(r"[a-z0-9]+", text.lower())) + " "
    best, hits = "general", 0
    for label, words in KEYWORDS.items():
        count = sum(lowered.count(f" {word} ") for word in words)
        if count > hits:
            best, hits = label, count
    return best, hits


#: An e-mail address: a name character, `@`, a domain part, a dot, more domain (the possessive
#: `++` never backtracks into the part, so each `@` costs the part's length once).
_EMAIL = re.compile(r"[\w.+-]@[\w-]++\.[\w.]")
#: A run of the characters phone numbers are written with, starting where a run starts (so a
#: long run is scanned once, not again from each of its characters).
_PHONE_RUN = re.compile(r"(?<![\d ()-])[\d ()-]{9,}")
_PHONE_PUNCTUATION = " ()-"


def mentions_personal_data(summary: object) -> bool:
    """`/summary`'s moderation: a label must not carry an e-mail address or a phone number
    (labels end up in dashboards, where personal data must not).

    A phone number is a digit, seven or more digits, spaces, dashes or parentheses, and a
    digit: a run of those characters whose first and last digits are eight or more apart.
    Linear in the text's size (no pattern here backtracks over the text more than once).
    """
    text = str(getattr(summary, "label", summary))
    if _EMAIL.search(text):
        return True
    return any(len(run.strip(_PHONE_PUNCTUATION)) >= 9 for run in _PHONE_RUN.findall(text))
