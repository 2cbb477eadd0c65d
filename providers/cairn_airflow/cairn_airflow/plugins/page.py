"""The snapshots page: server-rendered HTML with an inline SVG chart, no JavaScript.

Airflow shows external views in an iframe sandboxed without ``allow-scripts``, so the page
must work with scripts off; every value from the store or the request is HTML-escaped.
"""

from __future__ import annotations

from html import escape
from urllib.parse import urlencode

from cairn.runtime.units import human_size
from cairn_airflow.plugins.report import TaskReport

# Colors of successive attempts on the chart (Airflow-like, readable on white).
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#1a202c}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:20px 0 6px}
.meta{color:#4a5568;font-size:13px;margin:2px 0}
table{border-collapse:collapse;font-size:13px;margin-top:4px}
th,td{border-bottom:1px solid #e2e8f0;padding:4px 10px;text-align:right;white-space:nowrap}
th{background:#f7fafc;font-weight:600} td.l,th.l{text-align:left}
.ok{color:#2f855a} .bad{color:#c53030;font-weight:600} .muted{color:#718096}
.summary{background:#f0fff4;border:1px solid #c6f6d5;padding:8px 12px;margin:10px 0;
display:inline-block;font-size:14px}
.note{color:#744210;background:#fffff0;border:1px solid #fefcbf;padding:4px 8px;
font-size:13px;margin:4px 0}
a.button{border:1px solid #cbd5e0;padding:3px 8px;border-radius:4px;text-decoration:none;
color:#2b6cb0;font-size:13px}
"""


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _time(created_at: str) -> str:
    """``2026-11-29T22:04:04.123456Z`` as ``2026-11-29 22:04:04`` (UTC)."""
    return created_at[:19].replace("T", " ")


def _dash(value: object) -> str:
    return "–" if value is None else escape(str(value))


def _color(epoch: int, epochs: list[int]) -> str:
    return _PALETTE[epochs.index(epoch) % len(_PALETTE)] if epoch in epochs else "#4a5568"


def render_chart(report: TaskReport, *, width: int = 760, height: int = 260) -> str:
    """Step over time: one colored line per attempt, a dashed drop where a try restarted and a
    marker at the step it resumed after (the work it did not redo)."""
    if not report.points:
        return '<p class="muted" id="chart-empty">No committed snapshot with a step to chart.</p>'
    left, right, top, bottom = 56, 16, 16, 36
    t_max = max([p.t for p in report.points] + [r.t for r in report.resumes] + [1.0])
    s_max = max([p.step for p in report.points] + [r.step for r in report.resumes] + [1])
    epochs = [t.epoch for t in report.tries]

    def x(t: float) -> float:
        return left + (width - left - right) * t / t_max

    def y(step: float) -> float:
        return height - bottom - (height - top - bottom) * step / s_max

    parts = [f'<svg id="progress-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" role="img" aria-label="progress over time">',
             f'<line x1="{left}" y1="{y(0)}" x2="{width - right}" y2="{y(0)}" stroke="#a0aec0"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(0)}" stroke="#a0aec0"/>',
             f'<text x="{left - 6}" y="{y(s_max) + 4}" text-anchor="end" font-size="11">'
             f'{s_max}</text>',
             f'<text x="{left - 6}" y="{y(0) + 4}" text-anchor="end" font-size="11">0</text>',
             f'<text x="{width - right}" y="{height - 8}" text-anchor="end" font-size="11">'
             f'{escape(_fmt_seconds(t_max))}</text>',
             f'<text x="{left}" y="{height - 8}" font-size="11">time since the first attempt'
             '</text>',
             f'<text x="14" y="{top + 60}" font-size="11" transform="rotate(-90 14,{top + 60})">'
             'step</text>']
    for epoch in epochs:
        pts = [p for p in report.points if p.epoch == epoch]
        resume = next((r for r in report.resumes if r.epoch == epoch), None)
        color = _color(epoch, epochs)
        coords = ([(x(resume.t), y(resume.step))] if resume else []) + \
                 [(x(p.t), y(p.step)) for p in pts]
        if len(coords) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                         'stroke-width="2"/>')
        for p in pts:
            parts.append(f'<circle cx="{x(p.t):.1f}" cy="{y(p.step):.1f}" r="3" fill="{color}">'
                         f'<title>seq {p.seq}, step {p.step} (epoch {p.epoch})</title></circle>')
        if resume:
            # The saved work: the span from step 0 to the step resumed after.
            parts.append(f'<line x1="{x(resume.t):.1f}" y1="{y(0):.1f}" x2="{x(resume.t):.1f}" '
                         f'y2="{y(resume.step):.1f}" stroke="{color}" stroke-dasharray="4 3"/>')
            parts.append(f'<rect x="{x(resume.t) - 4:.1f}" y="{y(resume.step) - 4:.1f}" '
                         f'width="8" height="8" fill="white" stroke="{color}" stroke-width="2">'
                         f'<title>epoch {resume.epoch} resumed after step {resume.step} '
                         f'(seq {resume.from_seq})</title></rect>')
            right_half = x(resume.t) > width / 2
            parts.append(f'<text x="{x(resume.t) + (-6 if right_half else 6):.1f}" '
                         f'y="{y(resume.step / 2):.1f}" font-size="11" fill="{color}" '
                         f'text-anchor="{"end" if right_half else "start"}">'
                         f'{resume.step + 1} steps not redone</text>')
    parts.append("</svg>")
    return "".join(parts)


def _snapshot_table(report: TaskReport, epochs: list[int]) -> str:
    if not report.snapshots:
        return '<p class="muted" id="no-snapshots">No retained snapshots.</p>'
    rows = []
    for s in report.snapshots:
        css = "ok" if s.status in ("present", "verified") else "bad"
        ratio = "all reused" if s.dedup_ratio is None else f"{s.dedup_ratio:.1f}×"
        reused = (f" ({s.chunks_reused}/{s.chunks} chunks reused)"
                  if s.chunks and s.chunks_reused is not None else "")
        status = escape(s.status) + (f': <span class="muted">{escape(s.reason)}</span>'
                                     if s.reason else "")
        rows.append(
            f'<tr class="snapshot-row" data-seq="{s.seq}"><td>{s.seq}</td>'
            f'<td style="color:{_color(s.epoch, epochs)}">{s.epoch}</td>'
            f'<td>{_dash(s.step)}</td><td class="l">{escape(_time(s.created_at))}</td>'
            f'<td class="l">{escape(s.mode)}</td><td>{escape(human_size(s.bytes_logical))}</td>'
            f'<td>{escape(human_size(s.bytes_written))}</td>'
            f'<td class="l">{escape(ratio)}{escape(reused)}</td>'
            f'<td class="l {css}">{status}</td></tr>')
    return ('<table id="snapshots"><tr><th>seq</th><th>epoch</th><th>step</th>'
            '<th class="l">time (UTC)</th><th class="l">mode</th><th>size</th>'
            '<th>bytes written</th><th class="l">dedup</th><th class="l">verify</th></tr>'
            + "".join(rows) + "</table>")


def _tries_table(report: TaskReport, epochs: list[int]) -> str:
    if not report.tries:
        return '<p class="muted">No attempts recorded.</p>'
    rows = []
    for t in report.tries:
        resumed = ("fresh start" if t.resumed_from is None else
                   f"seq {t.resumed_from}" + (f", after step {t.resumed_step}"
                                              if t.resumed_step is not None else ""))
        airflow = (f"try {t.airflow_try}: {t.airflow_state or '?'}"
                   if t.airflow_try is not None else "–")
        outcome = (escape(t.outcome) if t.outcome else
                   "–" if report.outcomes_available else
                   '<span class="muted">not recorded</span>')
        rows.append(
            f'<tr class="try-row" data-epoch="{t.epoch}">'
            f'<td style="color:{_color(t.epoch, epochs)}">{t.epoch}</td>'
            f'<td class="l">{escape(_time(t.opened_at))}</td><td class="l">{_dash(t.mode)}</td>'
            f'<td class="l">{escape(resumed)}</td><td>{_dash(t.steps_saved)}</td>'
            f'<td>{escape(_fmt_seconds(t.seconds_saved))}</td><td>{t.snapshots}</td>'
            f'<td>{_dash(t.last_step)}</td>'
            f'<td>{escape(human_size(t.bytes_written)) if t.bytes_written is not None else "–"}'
            f'</td><td>{escape(_fmt_seconds(t.stall_s))}</td>'
            f'<td class="l">{escape(t.ended)}</td>'
            f'<td class="l">{escape(airflow)}</td><td class="l">{outcome}</td></tr>')
    return ('<table id="tries"><tr><th>epoch</th><th class="l">opened (UTC)</th>'
            '<th class="l">mode</th><th class="l">resumed from</th><th>steps not redone</th>'
            '<th>time saved</th><th>snapshots</th><th>last step</th><th>bytes written</th>'
            '<th>stalls</th><th class="l">ended</th>'
            '<th class="l">Airflow try</th><th class="l">outcome</th></tr>'
            + "".join(rows) + "</table>")


def _discard_form(report: TaskReport, discard_url: str, discarded: str | None) -> str:
    done = (f'<div class="note" id="discarded">{escape(discarded)} snapshot(s) discarded; the '
            'next try starts fresh.</div>' if discarded is not None else "")
    if report.state == "no records":
        return done
    # A required checkbox confirms without JavaScript (the iframe allows forms, not scripts).
    return (done + f'<h2>Discard</h2><form method="post" action="{escape(discard_url)}" '
            'id="discard-form"><label><input type="checkbox" required name="confirm"> '
            "forget this task's snapshots: the next try starts fresh, a try still running is "
            'fenced and stops</label> <button type="submit" id="discard">Discard snapshots'
            "</button></form>")


_STATE_WORDS = {
    "suspend-requested": "suspend asked, not honoured yet (the step stops at its next step() "
                         "or within cairn run's grace)",
    "suspended": "suspended: the final snapshot holds its progress; the task waits deferred",
    "resume-requested": "resume asked: the task continues from the suspend snapshot",
}


def _suspension_section(report: TaskReport, *, suspend_url: str | None,
                        resume_url: str | None, asked: str | None) -> str:
    """Where a suspension stands (who asked, when, why) and the suspend or resume form."""
    parts = []
    if asked in ("suspend", "resume"):
        parts.append(f'<div class="note" id="asked">{escape(asked)} asked.</div>')
    held = report.suspension
    if held is not None:
        why = f" ({held['reason']})" if held.get("reason") else ""
        state = str(held.get("state"))
        lines = [f'<b id="suspend-state">{escape(state)}</b>: '
                 f'{escape(_STATE_WORDS.get(state, state))}',
                 f'<span id="suspend-by">asked by {escape(str(held.get("by")))} at '
                 f'{escape(_time(str(held.get("at"))))} UTC{escape(why)}</span>, for epoch '
                 f'{escape(str(held.get("epoch")))}']
        if held.get("try_outcome"):
            lines.append(f"that try ended {escape(str(held['try_outcome']))}")
        if held.get("resumed_by"):
            where = (f", on {escape(str(held['placement']))}" if held.get("placement") else "")
            lines.append(f'<span id="resume-by">resume asked by {escape(str(held["resumed_by"]))}'
                         f' at {escape(_time(str(held.get("resumed_at"))))} UTC{where}</span>')
        parts.append('<p class="meta" id="suspension">' + " · ".join(lines) + "</p>")
    # Forms, not scripts: the iframe allows forms only. The reason is optional.
    if report.held and resume_url:
        # A pod-based step may move to another of its capacity options (cairn resume
        # --placement); the first choice leaves the placement to the policy.
        choices = "".join(f'<option value="{escape(name)}">on {escape(name)}</option>'
                          for name in report.move_options)
        where = ('<select name="placement" id="placement"><option value="">where the policy '
                 f"places it</option>{choices}</select> " if choices else "")
        parts.append(f'<form method="post" action="{escape(resume_url)}" id="resume-form">'
                     '<input name="reason" maxlength="200" placeholder="reason (optional)"> '
                     f'{where}<button type="submit" id="resume">Resume</button> the step '
                     "continues from its suspend snapshot</form>")
    elif report.running and suspend_url and (
            held is None or not report.tries or held.get("epoch") != report.tries[-1].epoch):
        # One suspend per try: a try whose suspend was cancelled by a resume keeps running.
        parts.append(f'<form method="post" action="{escape(suspend_url)}" id="suspend-form">'
                     '<input name="reason" maxlength="200" placeholder="reason (optional)"> '
                     '<button type="submit" id="suspend">Suspend</button> the running step '
                     "takes a final snapshot and stops; the task waits deferred until resumed"
                     "</form>")
    if not parts:
        return ""
    return "<h2>Suspend and resume</h2>" + "".join(parts)


def render_page(report: TaskReport, *, ti: dict[str, str], api_url: str,
                verify_url: str, discard_url: str | None = None,
                discarded: str | None = None, suspend_url: str | None = None,
                resume_url: str | None = None, asked: str | None = None) -> str:
    """The whole page for one task instance (``ti``: dag_id, task_id, run_id, map_index)."""
    epochs = [t.epoch for t in report.tries]
    title = f"{ti['dag_id']} / {ti['task_id']}"
    summary = ""
    if report.resumes:
        n = len(report.resumes)
        summary = (f'<div class="summary" id="saved">{n} resume{"" if n == 1 else "s"} skipped '
                   f'<b>{report.steps_saved}</b> steps'
                   + (f", about <b>{escape(_fmt_seconds(report.seconds_saved))}</b> of work "
                      f"({escape(_fmt_seconds(report.seconds_per_step))} per step measured)"
                      if report.seconds_saved is not None else "") + "</div>")
    notes = "".join(f'<div class="note">{escape(n)}</div>' for n in report.notes)
    verify = ("all chunks read and checked" if report.deep_verified else
              f'manifests and packs present; <a class="button" id="verify-link" '
              f'href="{escape(verify_url)}">verify every chunk</a>')
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f"<title>cairn snapshots: {escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>cairn snapshots: {escape(title)}</h1>"
        f'<p class="meta">run <code>{escape(ti["run_id"])}</code>, map index '
        f'{escape(ti["map_index"])} · key <code id="key">{escape(report.key)}</code> · '
        f'store <code>{escape(report.store)}</code> · state <b id="state">'
        f'{escape(report.state)}</b></p>'
        f'<p class="meta">verify: {verify} · <a href="{escape(api_url)}">JSON</a></p>'
        f"{notes}{summary}"
        + _suspension_section(report, suspend_url=suspend_url, resume_url=resume_url,
                              asked=asked)
        + "<h2>Progress</h2>" + render_chart(report)
        + "<h2>Snapshots</h2>" + _snapshot_table(report, epochs)
        + "<h2>Attempts</h2>" + _tries_table(report, epochs)
        + (_discard_form(report, discard_url, discarded) if discard_url else "")
        + "</body></html>")


def page_links(prefix: str, ti: dict[str, str]) -> tuple[str, str, str]:
    """The JSON API, deep-verify and discard URLs for the same task instance."""
    query = urlencode(ti)
    return (f"{prefix}/api/snapshots?{query}", f"{prefix}/snapshots?{query}&verify=deep",
            f"{prefix}/snapshots/discard?{query}")


def request_links(prefix: str, ti: dict[str, str]) -> tuple[str, str]:
    """The suspend and resume form URLs for the same task instance."""
    query = urlencode(ti)
    return f"{prefix}/snapshots/suspend?{query}", f"{prefix}/snapshots/resume?{query}"
