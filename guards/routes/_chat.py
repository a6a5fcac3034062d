"""A resumable route's chat: the `id` of the handler's `UIChatRequest` argument, noted in the
request's scope, under which the walk keeps the request's stream as the chat's current one
(the AI SDK's resume asks for `GET <path>/<chat id>/stream`: `guards.routes._resume`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from starlette.types import Scope

from ..walk._streaming import CHAT_ID

__all__ = ["note_chat"]


def note_chat(arguments: Mapping[str, Any], scope: Scope) -> None:
    """Note the chat id of the first `UIChatRequest` among the handler's `arguments`."""
    # An app that never loaded the UI message stream's module has no `UIChatRequest`; one that
    # did finds the class there (imported by nothing else: plain apps never load it).
    ui = sys.modules.get("guards.streams._ui_stream")
    if ui is None:
        return
    for value in arguments.values():
        if isinstance(value, ui.UIChatRequest):
            if value.id:
                scope[CHAT_ID] = value.id
            return
