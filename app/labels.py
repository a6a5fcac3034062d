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
_WORD = re.compile(r"[a-z0-9]+(?: [a-z0-9]+)?")


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


_PERSONAL_DATA = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+|\+?\d[\d ()-]{7,}\d")


def mentions_personal_data(summary: object) -> bool:
    """`/summary`'s moderation: a label must not carry an e-mail address or a phone number
    (labels end up in dashboards, where personal data must not)."""
    return bool(_PERSONAL_DATA.search(str(getattr(summary, "label", summary))))
