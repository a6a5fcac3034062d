"""The status page's HTML: one self-contained document (inline CSS, one inline script that
the Content-Security-Policy `CSP` allows by its hash), rendered on the server from a
`StatusReport`; and the sign-in page a browser gets with a 401. Every value is escaped, as
text."""

from __future__ import annotations

import base64
import hashlib
import html
import math
import time
from collections.abc import Mapping, Sequence

from ..contracts._vocabulary import Level
from ._chart import latency_cell
from ._history import DAY_S
from ._report import ModelStatus, RouteStatus, StatusReport

__all__ = ["CSP", "render_html", "render_sign_in"]


# --- the page ---------------------------------------------------------------------------------------

_CSS = """
:root{color-scheme:light dark;--bg:#f4f5f7;--card:#fff;--text:#1c2230;--muted:#5f6877;--line:#e2e5ea;
--ok:#17663a;--ok-bg:#dcf2e3;--warn:#7a4d00;--warn-bg:#fdeccb;--bad:#9b1c15;--bad-bg:#fbe0dd}
@media (prefers-color-scheme:dark){:root{--bg:#101318;--card:#191e25;--text:#e5e8ed;--muted:#98a1b0;
--line:#2a313b;--ok:#7ad69a;--ok-bg:#143022;--warn:#f2c66d;--warn-bg:#392b0c;--bad:#ff8f86;--bad-bg:#3b1714}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--text);
font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1040px;margin:0 auto;padding:20px 16px 32px}
header{display:flex;flex-wrap:wrap;align-items:center;gap:6px 14px;margin-bottom:18px}
h1{font-size:21px;margin:0}
header p{margin:0;flex-basis:100%;color:var(--muted);font-size:13px}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:14px 18px;margin-bottom:16px}
h2{font-size:15px;margin:0 0 10px}
h2 small{font-weight:400;color:var(--muted)}
table{width:100%;border-collapse:collapse}
th,td{text-align:left;padding:7px 12px 7px 0;border-top:1px solid var(--line);vertical-align:middle}
th:last-child,td:last-child{padding-right:0}
th{font-size:12px;font-weight:600;color:var(--muted);border-top:0;white-space:nowrap}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.name{font:600 13px/1.4 ui-monospace,"DejaVu Sans Mono",monospace;overflow-wrap:anywhere}
.pill{display:inline-block;padding:2px 10px;border-radius:999px;font-size:12px;font-weight:700;
letter-spacing:.03em;white-space:nowrap}
.level{font-size:13px;padding:4px 14px;text-transform:uppercase}
.good{color:var(--ok);background:var(--ok-bg)}.warn{color:var(--warn);background:var(--warn-bg)}
.bad{color:var(--bad);background:var(--bad-bg)}
.muted{color:var(--muted)}
.note{margin:10px 0 0;color:var(--muted);font-size:13px}
footer{color:var(--muted);font-size:12px;line-height:1.5}
form{display:flex;flex-wrap:wrap;gap:8px;align-items:center}
label{font-weight:600;flex-basis:100%}
input{flex:1 1 220px;font:inherit;padding:8px 10px;border:1px solid var(--line);border-radius:8px;
background:var(--bg);color:var(--text)}
button{font:inherit;font-weight:600;padding:8px 14px;border:0;border-radius:8px;background:var(--text);
color:var(--bg);cursor:pointer}
svg.trend{display:block;margin:4px 0 0 auto;color:var(--muted)}
@media (max-width:700px){
main{padding:14px 10px 24px}
section{padding:10px 12px}
thead{display:none}
table,tbody,tr,td{display:block;width:100%}
tr{border-top:1px solid var(--line);padding:8px 0}
tbody tr:first-child{border-top:0}
td{border:0;padding:2px 0;display:flex;justify-content:space-between;align-items:baseline;gap:16px;
text-align:right;font-size:14px}
td::before{content:attr(data-label);color:var(--muted);font-size:13px;text-align:left;flex:none}
td.name{display:block;text-align:left;font-size:14px;padding-bottom:4px}
td.name::before{content:none}
}
"""

#: The page's one script: every `data-refresh` seconds it asks for the page again (with the
#: operator token this tab was given, if any: a meta refresh could not send one) and swaps in its
#: `<main>`; on the sign-in page it keeps the token in `sessionStorage` and loads the page. The
#: page is the server's own, escaped HTML: the script never builds markup from data.
_SCRIPT = """
"use strict";
(() => {
  const KEY = "guards-status-token";
  let timer = 0;
  const schedule = () => {
    clearTimeout(timer);
    // The period of the page now shown (the sign-in page has none: it waits for the form).
    const every = Number(document.querySelector("main").dataset.refresh) * 1000;
    if (every > 0) timer = setTimeout(reload, every);
  };
  const bind = () => {
    const form = document.getElementById("sign-in");
    if (!form) return;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, form.elements.token.value.trim());
      reload();
    });
  };
  async function reload() {
    if (document.hidden) return schedule();
    const token = sessionStorage.getItem(KEY);
    const headers = {Accept: "text/html"};
    if (token) headers.Authorization = "Bearer " + token;
    try {
      const answer = await fetch(location.pathname, {headers, cache: "no-store"});
      if (answer.status === 401 && token) sessionStorage.removeItem(KEY);
      const page = new DOMParser().parseFromString(await answer.text(), "text/html");
      const main = page.querySelector("main");
      if (!main) throw new Error("HTTP " + answer.status);
      document.querySelector("main").replaceWith(document.adoptNode(main));
      document.title = page.title;
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
      bind();
    } catch (error) {
      const summary = document.getElementById("summary");
      if (summary && !summary.dataset.stale) {
        summary.dataset.stale = "1";
        summary.append(" · not refreshed: the app did not answer (trying again)");
      }
    }
    schedule();
  }
  bind();
  if (document.getElementById("sign-in") && sessionStorage.getItem(KEY)) reload();
  else schedule();
})();
"""
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
#: The HTML page loads nothing from anywhere and runs only its own script (by its hash), which
#: may fetch only this app: even a value that escaped escaping could not run or call out.
CSP = (
    f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; connect-src 'self'; "
    "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_LEVEL_CLASS = {Level.full: "good", Level.degraded: "warn", Level.minimal: "bad"}


def _e(value: object) -> str:
    """Every value the page shows goes through here: text, never markup."""
    return html.escape(str(value), quote=True)


def _duration(seconds: float) -> str:
    seconds = math.ceil(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60} min" if rest // 60 else f"{hours} h"


def _percent(share: float | None) -> str:
    return "—" if share is None else f"{share * 100:.0f} %"


def _limits(limits: Mapping[str, float], soft_limit: float | None) -> str:
    """A budget's limits, as `per_day 100 · spend_per_day $5.00`, and its soft limit."""
    shown = [
        f"{name} {_dollars(value) if name.startswith('spend_') else f'{value:,.0f}'}"
        for name, value in limits.items()
    ]
    if soft_limit is not None:
        shown.append(f"soft at {soft_limit:.0%}")
    return " · ".join(shown) or "none"


def _dollars(usd: float) -> str:
    if usd == 0:
        return "$0"
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4f}"


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(epoch))


def _cell(label: str, content: str, kind: str = "") -> str:
    """One table cell; `content` is already escaped markup, `label` names it on a phone."""
    css = f' class="{kind}"' if kind else ""
    return f'<td data-label="{_e(label)}"{css}><span>{content}</span></td>'


def _table(headers: Sequence[tuple[str, str]], rows: list[str]) -> str:
    head = "".join(
        f'<th class="{kind}">{_e(name)}</th>' if kind else f"<th>{_e(name)}</th>" for name, kind in headers
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _model_row(model: ModelStatus, now: float) -> str:
    if model.down:
        state = (
            f'<span class="pill bad">down</span> <span class="muted">{_e(_duration(model.down_for_s))}</span>'
        )
    else:
        state = '<span class="pill good">up</span>'
    if model.breaker is None:
        breaker = '<span class="muted">—</span>'
    elif model.breaker == "closed":
        breaker = "closed"
    else:
        wait = model.breaker_wait_s or 0.0
        when = f"probe in {_duration(wait)}" if wait > 0 else "probe due"
        breaker = f'<span class="pill warn">{_e(model.breaker.replace("_", "-"))}</span> <span class="muted">{_e(when)}</span>'
    cooldown = _e(_duration(model.cooldown_s)) if model.cooldown_s else '<span class="muted">—</span>'
    failure = model.last_failure
    if failure is None:
        last = '<span class="muted">none</span>'
    else:
        last = f'{_e(failure.kind.value)} <span class="muted">{_e(_duration(max(0.0, now - failure.at)))} ago</span>'
    calls = _e(model.calls) + (
        f' <span class="muted">({_e(model.failures)} failed)</span>' if model.failures else ""
    )
    spent = model.cost_usd_today
    cost = _e(_dollars(spent)) if spent is not None else '<span class="muted">no price</span>'
    return (
        f'<tr data-model="{_e(model.model)}">'
        + _cell("Model", _e(model.model), "name")
        + _cell("State", state)
        + _cell("Breaker", breaker)
        + _cell("Cooldown", cooldown)
        + _cell("Last failure", last)
        + _cell("Calls", calls, "num")
        + _cell("Latency p50 / p95", latency_cell(model.latency), "num")
        + _cell("Spent today", cost, "num")
        + "</tr>"
    )


def _route_row(route: RouteStatus) -> str:
    def share(rate: float | None, count: int, high: float) -> str:
        """A rate, with its count when there is one, marked from `high` on (the alerts' levels)."""
        text = _e(_percent(rate))
        if rate is not None and rate >= high:
            text = f'<span class="pill warn">{text}</span>'
        return text + (f' <span class="muted">({_e(count)})</span>' if count else "")

    outcomes = route.outcomes
    trips = ", ".join(f"{_e(t.guard)}/{_e(t.reason)} {_e(t.count)}" for t in route.trips[:3])
    return (
        f'<tr data-route="{_e(route.route)}">'
        + _cell("Route", _e(route.route), "name")
        + _cell("Requests", _e(route.requests), "num")
        + _cell("Per minute", _e(f"{route.per_minute:g}"), "num")
        + _cell("Errors", share(route.error_rate, outcomes.error, 0.1), "num")
        + _cell("Fallbacks", share(route.fallback_rate, outcomes.fallback, 0.2), "num")
        + _cell("Fallback model", share(route.fallback_model_rate, 0, 0.2), "num")
        + _cell("Invalid", _e(outcomes.invalid), "num")
        + _cell("Guards tripped", trips or '<span class="muted">none</span>')
        + "</tr>"
    )


def render_html(report: StatusReport, window_s: float) -> str:
    """The status page for `report` (`window_s`: the recent window it names)."""
    now = time.time()
    level = report.level
    summary, store = _summary(report)
    window = _duration(window_s)
    whose = (
        "every worker's counts"
        if report.recent.counts == "all_workers"
        else f"the counts of the worker that answered (pid {report.recent.worker})"
    )
    models = [_model_row(model, now) for model in report.models]
    routes = [_route_row(route) for route in report.routes]
    spend = _spend(report)
    main = f"""<main data-refresh="{_e(f"{report.refresh_s:g}")}">
<header>
<h1>Status</h1>
<span id="level" class="pill level {_LEVEL_CLASS[level]}">{_e(level.value)}</span>
<p id="summary">{_e(summary)}{_e(store)} · as of <time id="as-of">{_e(_clock(report.time))}</time> · refreshes every {_e(_duration(report.refresh_s))}</p>
</header>
<section id="models">
<h2>Models <small>· calls in the last {_e(window)}</small></h2>
{_table((("Model", ""), ("State", ""), ("Breaker", ""), ("Cooldown", ""), ("Last failure", ""), ("Calls", "num"), ("Latency p50 / p95", "num"), ("Spent today", "num")), models) if models else '<p class="muted">No guarded route names a model.</p>'}
</section>
<section id="routes">
<h2>Routes <small>· the last {_e(window)}</small></h2>
{_table((("Route", ""), ("Requests", "num"), ("Per minute", "num"), ("Errors", "num"), ("Fallbacks", "num"), ("Fallback model", "num"), ("Invalid", "num"), ("Guards tripped", "")), routes) if routes else '<p class="muted">No guarded routes.</p>'}
<p class="note">Errors: public errors and application failures; fallbacks: answers from a degrading
route's fallback (both among the requests that were not invalid). Fallback model: the answers a
later model of the chain served, among those a model served.</p>
</section>
<section id="spend">
<h2>Spend today</h2>
{spend}
</section>
<footer>
Level, breakers and cooldowns: read from the store, shared by every worker.
Calls, rates and spend: {_e(whose)}, over the last {_e(_duration(report.recent.seconds))}.
Last failures: the answering worker's (pid {_e(report.recent.worker)}).
</footer>
</main>"""
    return _document(f"{level.value} · status", main, report.refresh_s)


def _summary(report: StatusReport) -> tuple[str, str]:
    """The page's summary line: how many models are down, and what the store's state adds."""
    down = sum(model.down for model in report.models)
    summary = f"{down} of {len(report.models)} models down" if report.models else "no models configured"
    store = "" if report.store == "ok" else " · store unavailable: level as last read, no breakers shown"
    resets = report.store_resets
    if resets is not None and resets.count:
        store += (
            f" · store forgot its state {resets.count} time{'s' if resets.count > 1 else ''}"
            f" (last noticed {_clock(resets.last or 0.0)}): caps, spend and breakers started over"
        )
    return summary, store


def _spend(report: StatusReport) -> str:
    """The "Spend today" section's content: the day's cost, and each budget scope's row."""
    cap_rows = [
        "<tr>"
        + _cell("Budget scope", _e(budget.scope), "name")
        + _cell("Routes", _e(", ".join(budget.routes)))
        + _cell("Limits per key", _e(_limits(budget.limits, budget.soft_limit)))
        + _cell("Spent today", _e(_dollars(budget.spent_usd_today)), "num")
        + _cell("Tokens today", _e(f"{budget.tokens_today:,}"), "num")
        + "</tr>"
        for budget in report.budgets
    ]
    today = report.today
    since = (
        "the start of the day"
        if today.since % DAY_S == 0
        else f"{_clock(today.since)} (the answering worker's start)"
    )
    spend = (
        f"<p><strong>{_e(_dollars(today.cost_usd))}</strong> spent on {_e(today.day)} (UTC) since "
        f"{_e(since)}, by priced calls.</p>"
    )
    if cap_rows:
        spend += _table(
            (
                ("Budget scope", ""),
                ("Routes", ""),
                ("Limits per key", ""),
                ("Spent today", "num"),
                ("Tokens today", "num"),
            ),
            cap_rows,
        )
        spend += '<p class="note">Each limit applies to each budget key on its own; spent and tokens are every key\'s together, what one key spent is not shown here.</p>'
    else:
        spend += '<p class="note">No route has a budget.</p>'
    return spend


def render_sign_in(refused: bool) -> str:
    """The 401 page a browser gets without the operator token (or with a wrong one): a form
    that keeps the token in the tab's `sessionStorage` and loads the page with it."""
    why = (
        "That token was refused."
        if refused
        else "This page needs the operator token (the app's STATUS_TOKEN)."
    )
    main = f"""<main>
<header><h1>Status</h1><p id="summary">{_e(why)}</p></header>
<section>
<form id="sign-in" autocomplete="off">
<label for="token">Operator token</label>
<input id="token" name="token" type="password" required autocomplete="off" spellcheck="false">
<button type="submit">Show the status</button>
</form>
<p class="note">Kept in this tab only (sessionStorage) and sent as
<code>Authorization: Bearer</code>; never in the address.</p>
</section>
</main>"""
    return _document("sign in · status", main, None)


def _document(title: str, main: str, refresh_s: float | None) -> str:
    """One self-contained page: inline CSS and the one inline script CSP allows (by its hash).
    The script reloads `<main>` every `refresh_s` seconds (None: the sign-in page, which waits
    for the form); without scripts, a meta refresh reloads the whole page instead."""
    refresh = "" if refresh_s is None else f"{refresh_s:g}"
    fallback = (
        f'<noscript><meta http-equiv="refresh" content="{_e(refresh)}"></noscript>\n' if refresh else ""
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{fallback}<meta name="robots" content="noindex">
<meta name="referrer" content="no-referrer">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
{main}
<script>{_SCRIPT}</script>
</body>
</html>
"""
