"""Composers for transactional mail: signup verification, and messages enqueued by applications.

Transactional mail carries no List-Unsubscribe: it is not a mailing list.
"""

from __future__ import annotations

from html import escape
from typing import Any

from sendonce.delivery.compose import ComposeError, Composer, Links, Sender, TransactionalComposer, wire_address
from sendonce.domain.jobs import JOB_ID_HEADER, message_id
from sendonce.domain.keys import SIGNUP_EVENT
from sendonce.domain.message import OutgoingMessage, format_address, is_header_name, is_reserved_header
from sendonce.store.outbox import ClaimedDelivery

_VERIFY_TEXT = {
    "en": (
        "Confirm your email address",
        "Hello{name},\n\nPlease confirm your email address by opening this link:\n\n{url}\n\n"
        "If you did not sign up, ignore this message.\n",
        "Confirm my address",
    ),
    "fr": (
        "Confirmez votre adresse e-mail",
        "Bonjour{name},\n\nMerci de confirmer votre adresse e-mail en ouvrant ce lien :\n\n{url}\n\n"
        "Si vous ne vous êtes pas inscrit, ignorez ce message.\n",
        "Confirmer mon adresse",
    ),
    "es": (
        "Confirma tu dirección de correo",
        "Hola{name}:\n\nConfirma tu dirección de correo abriendo este enlace:\n\n{url}\n\n"
        "Si no te has registrado, ignora este mensaje.\n",
        "Confirmar mi dirección",
    ),
    "ca": (
        "Confirma la teva adreça electrònica",
        "Hola{name},\n\nConfirma la teva adreça electrònica obrint aquest enllaç:\n\n{url}\n\n"
        "Si no t'has registrat, ignora aquest missatge.\n",
        "Confirmar la meva adreça",
    ),
}


def _base(delivery: ClaimedDelivery, sender: Sender, date: str, name: str | None) -> dict[str, Any]:
    recipient, smtputf8 = wire_address(delivery.email)
    return {
        "job_id": delivery.job_id,
        "envelope_from": sender.envelope_from,
        "recipient": recipient,
        "smtputf8": smtputf8,
        "from_header": sender.from_header,
        "to_header": format_address(name, recipient),
        "message_id": message_id(delivery.job_id, sender.domain),
        "date": date,
        "headers": [(JOB_ID_HEADER, delivery.job_id)],
        "dkim": sender.signing_key(),
        "key_maybe_used": delivery.uncertain,
    }


def compose_signup_verification(delivery: ClaimedDelivery, sender: Sender, date: str) -> OutgoingMessage:
    payload = delivery.payload
    url = payload.get("verify_url")
    if not isinstance(url, str) or not url:
        raise ComposeError("the verification event has no link")
    locale = str(payload.get("locale") or "en").lower().replace("_", "-").split("-")[0]
    subject, body, button = _VERIFY_TEXT.get(locale, _VERIFY_TEXT["en"])
    name = payload.get("name") if isinstance(payload.get("name"), str) else None
    greeting = f" {name}" if name else ""
    text = body.format(name=greeting, url=url)
    html = (
        f"<p>{escape(body.split(chr(10))[0].format(name=greeting))}</p>"
        f'<p><a href="{escape(url, quote=True)}" '
        'style="display:inline-block;padding:10px 18px;background:#2457d6;color:#fff;text-decoration:none;'
        f'border-radius:4px">{escape(button)}</a></p>'
        f'<p style="font-size:12px;color:#666">{escape(url)}</p>'
    )
    return OutgoingMessage(subject=subject, text=text, html=html, **_base(delivery, sender, date, name))


def compose_message(delivery: ClaimedDelivery, sender: Sender, date: str) -> OutgoingMessage:
    payload = delivery.payload
    subject, text, html = payload.get("subject"), payload.get("text"), payload.get("html")
    if not isinstance(subject, str) or not isinstance(text, str):
        raise ComposeError("the message has no subject or text")
    base = _base(delivery, sender, date, None)
    extra = payload.get("headers") or {}
    if isinstance(extra, dict):
        # checked at enqueue (sendonce.outbox); rows written before that check are checked here
        for name, value in extra.items():
            if not isinstance(name, str) or not is_header_name(name):
                raise ComposeError(f"{name!r} is not a header name")
            if not is_reserved_header(name):
                base["headers"].append((name, str(value)))  # encode_header_value makes line breaks spaces
    return OutgoingMessage(subject=subject, text=text, html=html if isinstance(html, str) else None, **base)


def compose_list_confirmation(delivery: ClaimedDelivery, sender: Sender, date: str) -> OutgoingMessage:
    payload = delivery.payload
    url, list_name = payload.get("confirm_url"), payload.get("list_name")
    if not isinstance(url, str) or not isinstance(list_name, str):
        raise ComposeError("the confirmation event has no link or list")
    name = payload.get("name") if isinstance(payload.get("name"), str) else None
    text = (
        f"Hello{' ' + name if name else ''},\n\nPlease confirm that you want to receive {list_name}:\n\n{url}\n\n"
        "If you did not ask for it, ignore this message: you will not be subscribed.\n"
    )
    html = (
        f"<p>Please confirm that you want to receive <b>{escape(list_name)}</b>.</p>"
        f'<p><a href="{escape(url, quote=True)}">Yes, subscribe me</a></p>'
        '<p style="font-size:12px;color:#666">If you did not ask for it, ignore this message.</p>'
    )
    return OutgoingMessage(
        subject=f"Confirm your subscription to {list_name}", text=text, html=html, **_base(delivery, sender, date, name)
    )


TRANSACTIONAL: dict[str, TransactionalComposer] = {
    SIGNUP_EVENT: compose_signup_verification,
    "list_confirmation_requested": compose_list_confirmation,
    "message": compose_message,
}


def default_composer(links: Links) -> Composer:
    return Composer(TRANSACTIONAL, links=links)
