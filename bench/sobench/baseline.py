"""The baseline most teams build: one procrastinate job per recipient, rendered and sent in the job.

Workers run as ``procrastinate --app sobench.baseline.app worker --concurrency C`` with
``SOBENCH_PQ_URL`` (the procrastinate database) and ``SOBENCH_SMTP_PORT`` set. A generous version of
the pattern: the job's arguments carry everything it needs (no database read in the job), templates
are compiled once per process, and each worker process keeps up to ``concurrency`` persistent SMTP
connections in a pool (the common version opens a connection per job, which is slower still).
"""

from __future__ import annotations

import contextlib
import functools
import os
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any

import aiosmtplib
import jinja2
from procrastinate import App, PsycopgConnector

from sobench.content import FROM_EMAIL, FROM_NAME, HTML, SUBJECT, TEXT

app = App(connector=PsycopgConnector(conninfo=os.environ.get("SOBENCH_PQ_URL", "")))

_idle: list[aiosmtplib.SMTP] = []


@functools.cache
def _templates() -> tuple[jinja2.Template, jinja2.Template, jinja2.Template]:
    env = jinja2.Environment(autoescape=False)  # subject and text are not HTML
    html_env = jinja2.Environment(autoescape=True)
    return env.from_string(SUBJECT), env.from_string(TEXT), html_env.from_string(HTML)


def render(campaign_id: int, subscriber_id: int, email: str, name: str) -> EmailMessage:
    subject, text, html = _templates()
    context: dict[str, Any] = {
        "email": email,
        "name": name,
        "subscriber": {"id": subscriber_id, "email": email, "name": name},
        "campaign": {"id": campaign_id},
    }
    message = EmailMessage()
    message["From"] = f"{FROM_NAME} <{FROM_EMAIL}>"
    message["To"] = f"{name} <{email}>"
    message["Subject"] = subject.render(context)
    message["Date"] = formatdate(usegmt=True)
    message["Message-ID"] = f"<campaign.{campaign_id}.{subscriber_id}@sender.test>"
    message.set_content(text.render(context))
    message.add_alternative(html.render(context), subtype="html")
    return message


async def _connection() -> aiosmtplib.SMTP:
    if _idle:
        return _idle.pop()
    smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=int(os.environ["SOBENCH_SMTP_PORT"]), timeout=30)
    await smtp.connect()
    return smtp


@app.task(name="send_campaign_email", queue="campaign")
async def send_campaign_email(campaign_id: int, subscriber_id: int, email: str, name: str) -> None:
    message = render(campaign_id, subscriber_id, email, name)
    smtp = await _connection()
    try:
        await smtp.send_message(message)
    except BaseException:
        with contextlib.suppress(Exception):
            smtp.close()
        raise
    _idle.append(smtp)
