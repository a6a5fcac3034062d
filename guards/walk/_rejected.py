"""Answers the output guard rejects, for a route that says what to do with them
(`route(on_rejected=...)`), and the calls of a route's declared tools (`route(tools=...)`):
`Answers`, attached to the route at start-up (`GuardedRoute.answers`; imported only then, and
only for such a route), and what it does per request (`Answers.run`, in place of `AI.run`'s
walk-then-check).

    fallback     the walk as any route's, the answer checked after it: a rejected answer ends
                 the request (the route's fallback, or 502 incompatible_model_response)
    next_model   the answer checked inside the walk, under its deadline: a rejected one is
                 accounted as `rejected` (with its problems), its model reported as having
                 answered (a success for its breaker: the provider is up), and the walk moves
                 to the next model, within the request's attempt budget
    reask        as next_model, but each model is first asked once more, with the problems
                 appended as a user turn (field paths and problem tokens, never the rejected
                 text): `messages` gain a user message, a `prompt` a paragraph

When no model is left, the walk ends with the last rejection, as a rejected answer always has.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..contracts._errors import GuardTripped
from ..contracts._output import INVALID_UNICODE
from ..contracts._unicode import has_lone_surrogate
from ..contracts._vocabulary import Reason
from ..stores._breaker import Outcome
from ._accounting import account, on_attempt
from ._chain_walk import walk
from ._state import Answered
from ._store_steps import finish_leg, report

if TYPE_CHECKING:
    from ..contracts._binding import AIResult
    from ..contracts._output import OutputGuard
    from ..contracts._tools import Tools
    from ..spec._route_spec import Leg
    from ..stores import Report
    from ._state import RequestState

__all__ = ["ON_REJECTED", "REASK_LEAD", "Answers", "reasked"]

#: What `route(on_rejected=...)` may say.
ON_REJECTED = ("fallback", "next_model", "reask")
#: The user turn of a reask: this, the problems joined by "; ", then `_REASK_END`.
REASK_LEAD = "Your previous answer was rejected: "
_REASK_END = ". Answer again, and fix these problems."
_INVALID = (f"answer: {INVALID_UNICODE}",)


def reasked(inputs: Mapping[str, Any], problems: tuple[str, ...]) -> Mapping[str, Any] | None:
    """`inputs` with the problems appended as a user turn: a user message after `messages`, or
    a paragraph after `prompt`; None when the inputs have neither (no turn to append to)."""
    turn = REASK_LEAD + ("; ".join(problems) or "it did not match what was asked") + _REASK_END
    messages = inputs.get("messages")
    if isinstance(messages, list | tuple):
        return {**inputs, "messages": [*messages, {"role": "user", "content": turn}]}
    prompt = inputs.get("prompt")
    if isinstance(prompt, str):
        return {**inputs, "prompt": f"{prompt}\n\n{turn}"}
    return None


class Answers:
    """What a route does with rejected answers (`on_rejected`), and its tools (None: none)."""

    __slots__ = ("moves_on", "on_rejected", "reasks", "tool_inputs", "tools")

    def __init__(self, on_rejected: str, tools: Tools | None) -> None:
        self.on_rejected = on_rejected
        self.tools = tools
        #: Whether a rejected answer moves the walk on (checked inside it), and whether each
        #: model is asked once more first.
        self.moves_on = on_rejected != "fallback"
        self.reasks = on_rejected == "reask"
        #: The `tools` input added to a call that does not set it.
        self.tool_inputs = [dict(d) for d in tools.definitions] if tools is not None else None

    async def run(self, state: RequestState, inputs: Mapping[str, Any], output: OutputGuard) -> Any:
        """`AI.run` (and `AI.step`) on such a route: the walk, its answer checked (inside it
        when rejected answers move on), the validated output returned. The route's tools apply
        to calls with the route's own output type."""
        tools = self.tools if output is state._route.output else None
        if tools is not None and "tools" not in inputs:
            inputs = {**inputs, "tools": self.tool_inputs}
        answered = getattr(state, "_answered", None)
        if answered is None:
            answered = state._answered = Answered()
        check = Check(self, output, tools, inputs, answered)
        leg, result, probe, record_success = await walk(state, inputs, None, check if self.moves_on else None)
        if record_success or probe is not None or state._hold is not None:
            await finish_leg(state, leg, Outcome.success, probe, record_success)
        else:  # not reported: the next step about the model tells the store
            leg.last_success[0] = state._shared.success_clock()
        state._served(leg, result.model)
        if check.accepted:
            return check.value
        return await check.answer(result)

    def logged(self, state: RequestState) -> dict[str, Any] | None:
        """The request line's `rejected` field: each rejected answer's model and problems."""
        answered: Answered | None = getattr(state, "_answered", None)
        if answered is None or not answered.rejected:
            return None
        return {"rejected": [{"model": entry, "problems": list(found)} for entry, found in answered.rejected]}

    def rejected_header(self, state: RequestState, mode: str) -> str | None:
        """`x-ai-rejected`: the chain entries whose answers were rejected, in order, one per
        answer (`detailed`); their number (`redacted`); None when none was (or `off`)."""
        answered: Answered | None = getattr(state, "_answered", None)
        if mode == "off" or answered is None or not answered.rejected:
            return None
        if mode == "redacted":
            return str(len(answered.rejected))
        return ",".join(entry for entry, _ in answered.rejected)


class Check:
    """One walk's check of its answers (`walk(..., check)`): the accepted answer's value, and
    which models were asked once more."""

    __slots__ = ("_answered", "_answers", "_inputs", "_output", "_reasked", "_tools", "accepted", "value")

    def __init__(
        self,
        answers: Answers,
        output: OutputGuard,
        tools: Tools | None,
        inputs: Mapping[str, Any],
        answered: Answered,
    ) -> None:
        self._answers = answers
        self._output = output
        self._tools = tools
        self._inputs = inputs  # the walk's own: a reask's turn is for its model only
        self._answered = answered
        self._reasked: set[int] = set()
        self.accepted = False
        self.value: Any = None

    async def answer(self, result: AIResult) -> Any:
        """The validated output of `result`, or `GuardTripped` (output reasons). An answer with
        tool calls, on a route with tools, is its calls (`AI.tool_calls`), each validated, and
        its text, "" when none: its text is checked for lone surrogates only."""
        tools = self._tools
        if tools is not None and result.tool_calls and not result.moderated:
            self._answered.tool_calls = tools.check(result)
            text = result.response
            if not isinstance(text, str):
                return ""
            if has_lone_surrogate(text):
                raise GuardTripped(
                    Reason.schema_invalid, "the answer's text is not valid Unicode", problems=_INVALID
                )
            return text
        self._answered.tool_calls = ()
        output = self._output
        return output.check_shape(result) if output.moderation is None else await output.check(result)

    async def moved_on(
        self,
        state: RequestState,
        leg: Leg,
        index: int,
        result: AIResult,
        started: float,
        probe: float | None,
        record_success: bool,
    ) -> tuple[Report | None, GuardTripped, int, Mapping[str, Any]] | None:
        """After a call to `leg` (the chain's `index`th) answered `result`: None when the answer
        is accepted (`value`); else, the answer accounted as rejected, (the report of the call,
        the rejection, the leg to call next, its inputs)."""
        try:
            self.value = await self.answer(result)
        except GuardTripped as tripped:
            rejection = tripped
        except BaseException:  # the deadline, or the moderation hook's own failure
            on_attempt(state, result, started)
            raise
        else:
            self.accepted = True
            return None
        problems = rejection.problems
        state.attempts += 1
        served = result.model or leg.ref.model
        account(
            state,
            leg,
            "rejected",
            result.usage,
            served,
            perf_counter() - started,
            billed=True,
            problems=problems,
        )
        leg.last_success[0] = state._shared.success_clock()
        made = (
            report(state, leg, Outcome.success, probe, settle=False)
            if record_success or probe is not None
            else None
        )
        state._served(leg, result.model)
        self._answered.rejected.append((leg.ref.entry, problems))
        state._note(leg, f"rejected ({'; '.join(problems) or rejection.reason.value})", None)
        last = GuardTripped(
            rejection.reason, rejection.detail, attempts=state.attempts, model=leg.ref.key, problems=problems
        )
        if self._answers.reasks and index not in self._reasked:
            again = reasked(self._inputs, problems)
            if again is not None:
                self._reasked.add(index)
                return made, last, index, again
        return made, last, index + 1, self._inputs
