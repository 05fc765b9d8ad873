"""What each provider posts to ``POST /v1/webhooks/{provider}``, and the headers that sign it, for the
route's OpenAPI document: the route reads its raw body itself (signatures cover the exact bytes), so
FastAPI cannot infer either.

Each body is described by what its parser reads. Providers send more than that, which is accepted and
ignored, except in our own ``generic`` format: it refuses unknown fields. One operation serves every
provider, so the body is any of the formats (each titled with its provider's name) and every signature
header is optional: which ones a request needs depends on the provider in its path.
"""

from __future__ import annotations

from typing import Any, Final

from sendonce.domain.jobs import JOB_ID_HEADER
from sendonce.webhooks import generic, postmark, resend, sendgrid, ses

_TEXT: Final = {"type": "string", "minLength": 1}
_TIME: Final = {"type": "string", "format": "date-time"}
_UNIX_SECONDS: Final = {"type": "string", "pattern": "^[0-9]{1,12}$"}


def _one_of_or_other(known: list[str], description: str) -> dict[str, Any]:
    """A string naming a kind: the ones the parser tells apart, or any other (recorded as ``other``)."""
    return {"anyOf": [{"enum": known}, _TEXT], "description": description}


GENERIC: Final = {
    "title": generic.PROVIDER,
    "description": (
        "Our own format, for any sender that can make an HTTP request. Signed with the `Sendonce-Timestamp`"
        " and `Sendonce-Signature` headers; unknown fields are refused."
    ),
    "type": "object",
    "properties": {
        "events": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 200,
                        "description": "Unique per event (and per request): an event sent again is applied once.",
                    },
                    "type": {"enum": list(generic.TYPES)},
                    "email": {**_TEXT, "description": "The recipient."},
                    "job_id": {
                        "type": ["string", "null"],
                        "description": f"The message's `{JOB_ID_HEADER}` header, which links the event to its"
                        " delivery.",
                    },
                    "account_id": {
                        "type": ["integer", "null"],
                        "minimum": 1,
                        "maximum": 2**63 - 1,
                        "description": "The account, for an event that names no delivery.",
                    },
                    "occurred_at": {**_TIME, "type": ["string", "null"], "description": "With its UTC offset."},
                    "detail": {
                        "type": ["object", "null"],
                        "description": "Diagnostics kept with the event: at most 4096 bytes of JSON.",
                    },
                },
                "required": ["id", "type", "email"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["events"],
    "additionalProperties": False,
}

_NAME_VALUE_LIST: Final = {
    "type": "array",
    "items": {"type": "object", "properties": {"name": {"type": "string"}, "value": {"type": "string"}}},
}

RESEND: Final = {
    "title": resend.PROVIDER,
    "description": "A Resend event, delivered by Svix: signed with the `svix-id`, `svix-timestamp` and"
    " `svix-signature` headers.",
    "type": "object",
    "properties": {
        "type": _one_of_or_other(["email.bounced", "email.complained", "email.delivered"], "The event type."),
        "created_at": _TIME,
        "data": {
            "type": "object",
            "properties": {
                "email_id": {"type": "string", "description": "Resend's id of the message."},
                "to": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                "bounce": {
                    "type": "object",
                    "properties": {
                        "type": {"type": "string", "description": "Permanent (the default) or Transient."},
                        "subType": {"type": "string"},
                        "message": {"type": "string"},
                    },
                },
                "headers": {
                    "anyOf": [
                        {"type": "object", "properties": {JOB_ID_HEADER: {"type": "string"}}},
                        {**_NAME_VALUE_LIST, "description": "The same as a list of {name, value}."},
                    ],
                    "description": f"The message's headers, of which `{JOB_ID_HEADER}` links the event to its"
                    " delivery.",
                },
                "tags": {
                    "anyOf": [
                        {"type": "object", "properties": {"sendonce-job-id": {"type": "string"}}},
                        _NAME_VALUE_LIST,
                    ],
                    "description": "The message's tags: `sendonce-job-id` links the event to its delivery when"
                    " the headers do not.",
                },
            },
        },
    },
    "required": ["type", "data"],
}

_POSTMARK_COMMON: Final = {
    "MessageID": {**_TEXT, "description": "Postmark's id of the message."},
    "Metadata": {
        "type": "object",
        "properties": {"sendonce-job-id": {"type": "string"}},
        "description": "Set when the message was sent: `sendonce-job-id` links the event to its delivery.",
    },
    "Headers": {
        "type": "array",
        "items": {"type": "object", "properties": {"Name": {"type": "string"}, "Value": {"type": "string"}}},
    },
}

POSTMARK: Final = {
    "title": postmark.PROVIDER,
    "description": "One Postmark webhook record, authenticated by the `X-Sendonce-Webhook-Token` header or the"
    " password of HTTP Basic auth (Postmark signs nothing).",
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "RecordType": {"enum": ["Bounce", "SpamComplaint"]},
                "ID": {"type": "integer", "description": "The event id."},
                "Type": _one_of_or_other(
                    sorted(postmark.HARD_TYPES | postmark.SOFT_TYPES | {"SpamComplaint"}), "The bounce type."
                ),
                "TypeCode": {"type": "integer"},
                "Email": _TEXT,
                "BouncedAt": _TIME,
                "Description": {"type": "string"},
                "Details": {"type": "string"},
                "Inactive": {"type": "boolean"},
                **_POSTMARK_COMMON,
            },
            "required": ["RecordType", "ID", "Type", "Email"],
        },
        {
            "type": "object",
            "properties": {
                "RecordType": {"const": "Delivery"},
                "Recipient": _TEXT,
                "DeliveredAt": _TIME,
                "Details": {"type": "string"},
                **_POSTMARK_COMMON,
            },
            "required": ["RecordType", "MessageID", "Recipient"],
        },
        {
            "type": "object",
            "properties": {
                "RecordType": {"enum": ["Open", "Click"]},
                "Recipient": _TEXT,
                "ReceivedAt": _TIME,
                **_POSTMARK_COMMON,
            },
            "required": ["RecordType", "MessageID", "Recipient", "ReceivedAt"],
        },
        {
            "type": "object",
            "properties": {
                "RecordType": {"const": "SubscriptionChange"},
                "Recipient": _TEXT,
                "ChangedAt": _TIME,
                "SuppressSending": {"type": "boolean"},
                "SuppressionReason": {"type": "string"},
                **_POSTMARK_COMMON,
            },
            "required": ["RecordType", "MessageID", "Recipient", "ChangedAt"],
        },
    ],
}

SENDGRID: Final = {
    "title": sendgrid.PROVIDER,
    "description": "A batch of SendGrid events (the Signed Event Webhook): signed with the"
    " `X-Twilio-Email-Event-Webhook-Timestamp` and `X-Twilio-Email-Event-Webhook-Signature` headers.",
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "event": _one_of_or_other(["bounce", "dropped", "spamreport", "delivered"], "The event type."),
            "email": _TEXT,
            "sg_event_id": {**_TEXT, "description": "The event id."},
            "sg_message_id": {"type": "string"},
            "timestamp": {"type": "integer", "description": "Unix seconds."},
            "type": {"enum": ["bounce", "blocked"], "description": "Of a bounce: blocked is temporary."},
            "reason": {"type": "string"},
            "status": {"type": "string"},
            "response": {"type": "string"},
            "bounce_classification": {"type": "string"},
            sendgrid.JOB_ID_ARG: {
                "type": "string",
                "description": "The custom argument set when the message was sent: links the event to its delivery.",
            },
        },
        "required": ["event", "email", "sg_event_id"],
    },
}

SES: Final = {
    "title": ses.PROVIDER,
    "description": "An Amazon SNS message carrying an SES notification, signed inside the message (`Signature`,"
    " by the certificate at `SigningCertURL`). Only the topics in SENDONCE_SNS_TOPIC_ARNS are accepted.",
    "type": "object",
    "properties": {
        "Type": {"enum": [ses.NOTIFICATION, *sorted(ses.CONFIRMATIONS)]},
        "MessageId": _TEXT,
        "TopicArn": _TEXT,
        "Subject": {"type": "string"},
        "Message": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "The SES record (notificationType or eventType: Bounce, Complaint, Delivery, ...), as"
            " JSON text.",
        },
        "Timestamp": _TIME,
        "SignatureVersion": {"enum": ["1", "2"]},
        "Signature": {"type": "string", "contentEncoding": "base64"},
        "SigningCertURL": {"type": "string", "format": "uri"},
        "SubscribeURL": {"type": "string", "format": "uri"},
        "Token": {"type": "string"},
    },
    "required": [
        "Type",
        "MessageId",
        "TopicArn",
        "Message",
        "Timestamp",
        "SignatureVersion",
        "Signature",
        "SigningCertURL",
    ],
}

BODIES: Final = (GENERIC, RESEND, POSTMARK, SENDGRID, SES)


def _header(name: str, description: str, schema: dict[str, Any] = _TEXT) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "description": description, "schema": schema}


HEADERS: Final = [
    _header(generic.TIMESTAMP_HEADER.title(), "generic: the time of signing, in unix seconds.", _UNIX_SECONDS),
    _header(
        generic.SIGNATURE_HEADER.title(),
        "generic: `sha256=` and the hex HMAC-SHA256, keyed with SENDONCE_WEBHOOK_SECRET, of"
        ' "<Sendonce-Timestamp>.<raw body>".',
        {"type": "string", "pattern": "^sha256=[0-9a-fA-F]{64}$"},
    ),
    _header("svix-id", "resend: the message id, kept across retries (also read as webhook-id)."),
    _header("svix-timestamp", "resend: the time of signing, in unix seconds.", _UNIX_SECONDS),
    _header(
        "svix-signature",
        "resend: space-separated `v1,<base64 HMAC-SHA256>` of"
        ' "<svix-id>.<svix-timestamp>.<raw body>", keyed with SENDONCE_RESEND_WEBHOOK_SECRET (whsec_...).',
    ),
    _header(
        postmark.TOKEN_HEADER.title(),
        "postmark: the shared secret SENDONCE_POSTMARK_WEBHOOK_TOKEN (or as the password of HTTP Basic auth).",
    ),
    _header(sendgrid.TIMESTAMP_HEADER.title(), "sendgrid: the time of signing, in unix seconds.", _UNIX_SECONDS),
    _header(
        sendgrid.SIGNATURE_HEADER.title(),
        'sendgrid: the base64 ECDSA P-256 signature of "<timestamp><raw body>", checked with'
        " SENDONCE_SENDGRID_WEBHOOK_KEY.",
    ),
    _header("x-amz-sns-message-type", "ses: the SNS message type; when present it must equal the body's Type."),
]

OPENAPI: Final = {
    "parameters": HEADERS,
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"anyOf": list(BODIES)}},
            "text/plain": {
                "schema": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "description": "The same JSON as text: SNS posts with this type, and the body is read"
                    " whatever its type.",
                }
            },
        },
    },
}
"""``openapi_extra`` of the webhook route."""
