"""The campaign every contender sends: one newsletter (text + HTML), one recipient per message.

sendonce renders it with its own composer; the bare loop sends bytes pre-rendered by the very same
code (sendonce's template compiler and MIME writer), so both put the same size and shape on the
wire; the procrastinate baseline renders it per job the way most teams would (Jinja2 and the
standard library's ``EmailMessage``).
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

FROM_EMAIL = "news@sender.test"
FROM_NAME = "Acme News"
DOMAIN = "example.test"
SUBJECT = "{{ name }}, your November news from Acme"
TEXT = """Hello {{ name }},

Here is what happened at Acme in November. We shipped the new dashboard, fixed the export that
some of you reported as slow, and opened two new data centres. Thank you for the feedback that
made each of these possible.

- The dashboard now loads in under a second, even for large accounts.
- Exports of more than a million rows stream as they are built.
- Our status page has a new history view.

You receive this mail at {{ email }} because you subscribed to Acme News.
Read it online: https://news.acme.test/2026/11?s={{ subscriber.id }}

The Acme team
"""
HTML = """<!doctype html>
<html><body style="font-family: Helvetica, Arial, sans-serif; color: #222; max-width: 600px; margin: auto">
<h1 style="font-size: 22px">Hello {{ name }},</h1>
<p>Here is what happened at Acme in November. We shipped the new dashboard, fixed the export that
some of you reported as slow, and opened two new data centres. Thank you for the feedback that made
each of these possible.</p>
<ul>
  <li>The dashboard now loads in under a second, even for large accounts.</li>
  <li>Exports of more than a million rows stream as they are built.</li>
  <li>Our status page has a new history view.</li>
</ul>
<p><a href="https://news.acme.test/2026/11?s={{ subscriber.id }}" style="color: #0a58ca">Read it online</a></p>
<p style="font-size: 12px; color: #777">You receive this mail at {{ email }} because you subscribed to
Acme News.</p>
</body></html>
"""


def recipient(i: int) -> tuple[str, str]:
    """Address and name of subscriber number ``i`` (1-based, as the subscriber ids the setup makes)."""
    return f"user{i:07d}@{DOMAIN}", f"User {i}"


@dataclass(frozen=True)
class Prerendered:
    envelope_from: str
    recipient: str
    data: bytes


@functools.cache
def _templates() -> tuple[Any, Any, Any]:
    from sendonce.delivery.compose import compile_campaign

    return compile_campaign(subject=SUBJECT, text=TEXT, html=HTML)


_BOUNDARY = secrets.token_hex(12)


def sendonce_message(i: int, campaign_id: int = 1) -> Prerendered:
    """Message ``i`` exactly as sendonce's campaign composer writes it."""
    from sendonce.domain.jobs import JOB_ID_HEADER, message_id
    from sendonce.domain.message import OutgoingMessage, format_address

    subject, text, html = _templates()
    email, name = recipient(i)
    job_id = f"campaign:{campaign_id}:{i}"
    context = {
        "email": email,
        "name": name,
        "attributes": {},
        "subscriber": {"id": i, "email": email, "name": name, "attributes": {}},
        "campaign": {"id": campaign_id, "name": "November news"},
    }
    message = OutgoingMessage(
        job_id=job_id,
        envelope_from=FROM_EMAIL,
        recipient=email,
        smtputf8=False,
        from_header=format_address(FROM_NAME, FROM_EMAIL),
        to_header=format_address(name, email),
        subject=subject.render(context),
        text=text.render(context),
        html=html.render(context),
        message_id=message_id(job_id, "sender.test"),
        date=formatdate(usegmt=True),
        headers=[(JOB_ID_HEADER, job_id)],
        boundary=f"=_so_{_BOUNDARY}",
    )
    return Prerendered(FROM_EMAIL, email, message.as_bytes())
