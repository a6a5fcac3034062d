"""Fallback chains: which models a route may call, in order, and where each one is served.

A chain entry is a string:

- `"provider:model"`, when `provider` names a binding given to `Guards(providers=...)` (or
  `"default"`, the main binding): that model at that provider;
- the name of a `Profile`: the profile's model, then its fallbacks, depth-first;
- anything else: a model id of the main binding (`"@cf/meta/llama-3.1-8b-instruct"`).

Chains are flattened once, at start-up. Dangling references, cycles, excessive depth, empty model
ids and duplicates are reported and removed; a provider prefix that names no configured provider
fails start-up instead (`ConfigurationError`): its credentials are missing, and quietly calling
another provider would change the route.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ._errors import ConfigurationError

__all__ = ["DEFAULT_PROVIDER", "MAX_PROFILE_DEPTH", "Chain", "ModelRef", "Profile", "flatten_chain"]

#: The provider name of the binding given to `Guards(binding)`.
DEFAULT_PROVIDER = "default"
#: Profiles nested deeper than this are cut off (and reported).
MAX_PROFILE_DEPTH = 8
_PROVIDER = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """One model of a chain: `model` at `provider` (None: the main binding)."""

    provider: str | None
    model: str

    @property
    def key(self) -> str:
        """How the model is named in keys, logs and headers: `model` or `provider:model`."""
        return self.model if self.provider is None else f"{self.provider}:{self.model}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A named model with the profiles to fall back on after it.

    `model` is a chain entry naming one model (`"openai:gpt-4o-mini"` or a main-binding id);
    `fallbacks` names other profiles, tried in order after this one (each with its own
    fallbacks, depth-first).
    """

    model: str
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Chain:
    """A flattened chain: the models in call order, and what was removed on the way."""

    models: tuple[ModelRef, ...]
    problems: tuple[str, ...] = ()


def flatten_chain(
    entries: Sequence[str],
    *,
    profiles: Mapping[str, Profile] | None = None,
    providers: Collection[str] = (),
) -> Chain:
    """Flatten `entries` (model specs and profile names) into an ordered chain of models.

    `providers` are the provider names a `"provider:model"` entry may use besides `"default"`.
    Problems that can be fixed by removing an entry are reported in `Chain.problems` (each a
    short sentence naming the entry); raises `ConfigurationError` for a provider prefix that
    names no configured provider.
    """
    profiles = profiles or {}
    known = {DEFAULT_PROVIDER, *providers}
    models: list[ModelRef] = []
    problems: list[str] = []
    seen: set[str] = set()

    def add(entry: str, where: str) -> None:
        ref = parse_model(entry, known)
        if ref is None:
            problems.append(f"{where}: empty model id removed")
        elif ref.key in seen:
            problems.append(f"{where}: duplicate model {ref.key!r} removed")
        else:
            seen.add(ref.key)
            models.append(ref)

    def expand(name: str, path: tuple[str, ...]) -> None:
        where = " -> ".join((*path, name))
        if name in path:
            problems.append(f"{where}: cycle removed")
            return
        if len(path) >= MAX_PROFILE_DEPTH:
            problems.append(f"{where}: deeper than {MAX_PROFILE_DEPTH} profiles, removed")
            return
        profile = profiles[name]
        add(profile.model, f"profile {name!r}")
        for reference in profile.fallbacks:
            if reference not in profiles:
                problems.append(f"{where}: fallback {reference!r} names no profile, removed")
            else:
                expand(reference, (*path, name))

    for entry in entries:
        entry = entry.strip()
        if entry in profiles:
            expand(entry, ())
        else:
            add(entry, f"entry {entry!r}")
    return Chain(tuple(models), tuple(problems))


def parse_model(entry: str, providers: Collection[str]) -> ModelRef | None:
    """One model spec as a `ModelRef`; None for an empty model id."""
    entry = entry.strip()
    prefix, colon, rest = entry.partition(":")
    if colon and _PROVIDER.match(prefix) and not prefix.startswith("@"):
        if prefix not in providers:
            raise ConfigurationError(
                f"model {entry!r} names provider {prefix!r}, which is not configured: give its "
                f"credentials (Guards(providers={{{prefix!r}: ...}})), or write "
                f"'{DEFAULT_PROVIDER}:{entry}' for a main-binding model id that contains ':'"
            )
        rest = rest.strip()
        if not rest:
            return None
        return ModelRef(None if prefix == DEFAULT_PROVIDER else prefix, rest)
    return ModelRef(None, entry) if entry else None
