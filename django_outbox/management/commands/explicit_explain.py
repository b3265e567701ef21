"""``manage.py explicit_explain <what>``: a job's timeline and verdict, from the stored data alone.

``<what>`` is an idempotency key, a task id, a dead letter id, an outbox event id, or a
business id found inside keys; each job found says the rule it matched by. Each line of
a timeline shows its time (``times.shown``) and the span since the line before.
``--json`` prints the same as data for tools (times in ISO 8601 with their offset). Nothing
found, or an argument that cannot be a key: one line on stderr and exit status 1.

``manage.py explicit_explain --since 02:50 [--until 03:20]`` asks the same of a time window:
every job that had something unusual in it, grouped by cause (``django_outbox.incident.window``).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_outbox import times
from django_outbox.incident import explain, window


class Command(BaseCommand):
    help = (
        "Explain what happened to a job: every publish, execution, attempt, takeover, "
        "effect and dead letter in time order, and a verdict. WHAT is an idempotency "
        "key, a task id, a dead letter id, an outbox event id or a business id."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "what", nargs="?", help="key, task id, dead letter id, event id or business id"
        )
        parser.add_argument("--json", action="store_true", help="print the explanation as JSON")
        parser.add_argument(
            "--since",
            help="a window's start instead of WHAT: 02:50 (UTC, today or yesterday) or an "
            "ISO 8601 time; lists every job with something unusual in the window",
        )
        parser.add_argument("--until", help="the window's end (default: now)")
        parser.add_argument(
            "--limit",
            type=int,
            default=window.DEFAULT_LIMIT,
            help="jobs named per cause in a window (the counts cover all)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["since"] or options["until"]:
            self.explain_window(options)
            return
        if not options["what"]:
            raise CommandError("say what to explain: a key, a task id, ... or --since TIME")
        try:
            found = explain.explain(options["what"])
        except explain.ExplainError as exc:
            raise CommandError(str(exc)) from None
        if options["json"]:
            data = {"query": options["what"], "matches": [e.as_data() for e in found]}
            self.stdout.write(json.dumps(data, indent=2, default=str))
            return
        if len(found) > 1:
            self.stdout.write(f"{len(found)} jobs match {options['what']!r}:\n")
        for explanation in found:
            title = explanation.key or f"task {', '.join(explanation.task_ids)}"
            if explanation.matched_by:
                title += f"  (matched as {explanation.matched_by})"
            self.stdout.write(self.style.MIGRATE_HEADING(title))
            for event in explanation.events:
                self.stdout.write(f"  {times.shown(event.at)}  {since(event.since)}  {event.text}")
            self.stdout.write(f"  verdict: {explanation.verdict}\n")

    def explain_window(self, options: dict[str, Any]) -> None:
        if options["what"]:
            raise CommandError(
                f"explain {options['what']!r} or a window (--since/--until), not both"
            )
        if not options["since"]:
            raise CommandError("a window needs --since (its start)")
        if options["limit"] < 1:
            raise CommandError(f"--limit {options['limit']}: at least 1")
        try:
            start = window.parse_time(options["since"])
            end = window.parse_time(options["until"]) if options["until"] else timezone.now()
            report = window.report(start, end)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if options["json"]:
            self.stdout.write(json.dumps(report.as_json(options["limit"]), indent=2))
        else:
            self.stdout.write(report.as_text(options["limit"]))


def since(seconds: float | None) -> str:
    """The span since the previous event, right-aligned: ``+31.002 s``."""
    return f"{'' if seconds is None else f'+{seconds:.3f} s':>12}"
