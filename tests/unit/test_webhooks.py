"""Webhook verification and parsing, with payloads signed for real inside the tests.

Every scheme is exercised with real keys: an RSA key and a self-signed X.509 certificate served
through the injected ``fetch_certificate`` (SNS), HMAC secrets (svix, generic), an ECDSA P-256 key
(SendGrid), a shared token (Postmark). The signing (in ``tests.helpers``, shared with the API fuzz)
is written from the providers' documents, independently of the code under test, and the published
test vectors of Svix (Standard Webhooks) and SendGrid are checked too.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema_rs  # schemathesis's JSON Schema validator
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sendonce.webhooks import (
    FeedbackEvent,
    PayloadError,
    SignatureError,
    SubscriptionConfirmation,
    WebhookConfig,
    WebhookError,
    parse_webhook,
    schemas,
)
from tests.helpers import (
    CERT_URL,
    GENERIC_SECRET,
    POSTMARK_TOKEN,
    SENDGRID_KEY,
    SENDGRID_PUBLIC,
    SNS_KEY,
    SVIX_SECRET,
    TOPIC,
    generic_headers,
    sendgrid_headers,
    sns_certificate,
    sns_sign,
    svix_headers,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TS = str(int(NOW.timestamp()))
JOB = "campaign:42:7"


def no_fetch(url: str) -> bytes:
    raise AssertionError(f"no certificate should be fetched ({url})")


def events_of(result: list[FeedbackEvent] | SubscriptionConfirmation) -> list[FeedbackEvent]:
    assert isinstance(result, list)
    for event in result:
        json.dumps(event.detail)  # always JSON-serializable
        assert event.occurred_at is None or event.occurred_at.utcoffset() == timedelta(0)
    return result


# == SES over SNS =================================================================================


def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


SNS_CERT = sns_certificate(SNS_KEY, not_before=NOW - timedelta(days=30), not_after=NOW + timedelta(days=300))


class Certificates:
    """The injected fetcher: serves PEMs by URL and records what was asked for."""

    def __init__(self, served: dict[str, bytes] | None = None) -> None:
        self.served = served if served is not None else {CERT_URL: SNS_CERT}
        self.fetched: list[str] = []

    def __call__(self, url: str) -> bytes:
        self.fetched.append(url)
        return self.served[url]


def sns_notification(
    record: dict[str, Any] | str,
    *,
    version: str = "1",
    message_id: str = "95df01b4-ee98-5cb9-9903-4c221d41eb5e",
    subject: str | None = None,
    cert_url: str = CERT_URL,
    topic: str = TOPIC,
    key: rsa.RSAPrivateKey = SNS_KEY,
) -> dict[str, Any]:
    envelope: dict[str, Any] = {
        "Type": "Notification",
        "MessageId": message_id,
        "TopicArn": topic,
        "Message": record if isinstance(record, str) else json.dumps(record),
        "Timestamp": "2026-03-01T11:59:58.123Z",
        "SignatureVersion": version,
        "SigningCertURL": cert_url,
        "UnsubscribeURL": f"https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe&SubscriptionArn={TOPIC}:c9135db0",
    }
    if subject is not None:
        envelope["Subject"] = subject
    sns_sign(envelope, key)
    return envelope


def sns_confirmation(message_type: str = "SubscriptionConfirmation", **overrides: Any) -> dict[str, Any]:
    envelope: dict[str, Any] = {
        "Type": message_type,
        "MessageId": "165545c9-2a5c-472c-8df2-7ff2be2b3b1b",
        "Token": "2336412f37fb687f5d51e6e241d09c805a5a57b30d712f794cc5f6a988666d92768dd60a747ba6f3beb71854e285d6ad",
        "TopicArn": TOPIC,
        "Message": f"You have chosen to subscribe to the topic {TOPIC}.\nTo confirm the subscription, visit the "
        "SubscribeURL included in this message.",
        "SubscribeURL": f"https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription&TopicArn={TOPIC}&Token=2336",
        "Timestamp": "2026-03-01T11:59:58.123Z",
        "SignatureVersion": "1",
        "SigningCertURL": CERT_URL,
        **overrides,
    }
    sns_sign(envelope)
    return envelope


def ses_mail(**extra: Any) -> dict[str, Any]:
    return {
        "timestamp": "2026-03-01T11:58:00.012Z",
        "source": "Acme <news@acme.example>",
        "sourceArn": "arn:aws:ses:us-east-1:123456789012:identity/acme.example",
        "sendingAccountId": "123456789012",
        "messageId": "0100018e0f9a5ca3-93c245fe-e333-46ae-8fed-96160d20cfab-000000",
        "destination": ["ann@example.com", "bob@example.net"],
        "headersTruncated": False,
        "headers": [
            {"name": "From", "value": "Acme <news@acme.example>"},
            {"name": "To", "value": "ann@example.com"},
            {"name": "sendonce-job-id", "value": JOB},  # header names are case-insensitive
            {"name": "Message-ID", "value": "<campaign.42.7@acme.example>"},
        ],
        "commonHeaders": {"from": ["Acme <news@acme.example>"], "to": ["ann@example.com"], "subject": "News"},
        **extra,
    }


def ses_bounce(bounce_type: str = "Permanent", **mail: Any) -> dict[str, Any]:
    """The classic feedback notification (notificationType), as in the SES documentation."""
    return {
        "notificationType": "Bounce",
        "bounce": {
            "bounceType": bounce_type,
            "bounceSubType": "General",
            "bouncedRecipients": [
                {
                    "emailAddress": "ann@example.com",
                    "action": "failed",
                    "status": "5.1.1",
                    "diagnosticCode": "smtp; 550 5.1.1 user unknown",
                },
                {"emailAddress": "Bob@Example.NET", "action": "failed", "status": "5.1.1"},
            ],
            "timestamp": "2026-03-01T11:58:02.669Z",
            "feedbackId": "0100018e0f9a6479-ae22395c-1f7d-4423-a9e5-e0715bffc731-000000",
            "remoteMtaIp": "192.0.2.10",
            "reportingMTA": "dsn; a4-8.smtp-out.us-east-1.amazonses.com",
        },
        "mail": ses_mail(**mail),
    }


def ses_complaint_event() -> dict[str, Any]:
    """The event-publishing shape (eventType), job id in a message tag and no headers."""
    mail = ses_mail(tags={"ses:configuration-set": ["feedback"], "sendonce-job-id": ["signup_7"]})
    del mail["headers"]
    return {
        "eventType": "Complaint",
        "complaint": {
            "feedbackId": "0100018e0f9a6479-2f8b9a1c-complaint-000000",
            "complaintSubType": None,
            "complainedRecipients": [{"emailAddress": "ann@example.com"}],
            "timestamp": "2026-03-01T11:59:00Z",
            "userAgent": "Mozilla/5.0",
            "complaintFeedbackType": "abuse",
            "arrivalDate": "2026-03-01T11:58:59.000Z",
        },
        "mail": mail,
    }


def ses_delivery() -> dict[str, Any]:
    return {
        "notificationType": "Delivery",
        "mail": ses_mail(destination=["ann@example.com"]),
        "delivery": {
            "timestamp": "2026-03-01T11:58:01.000Z",
            "processingTimeMillis": 546,
            "recipients": ["ann@example.com"],
            "smtpResponse": "250 ok: Message 64111812 accepted",
            "reportingMTA": "a8-70.smtp-out.amazonses.com",
            "remoteMtaIp": "192.0.2.20",
        },
    }


def ses(envelope: dict[str, Any] | bytes, config: WebhookConfig | None = None, **kw: Any) -> Any:
    body = envelope if isinstance(envelope, bytes) else json.dumps(envelope).encode()
    headers = kw.pop("headers", {"x-amz-sns-message-type": "Notification"})
    fetch = kw.pop("fetch", None) or Certificates()
    return parse_webhook(
        "ses", headers, body, config or WebhookConfig(), now=kw.pop("now", NOW), fetch_certificate=fetch
    )


@pytest.mark.parametrize("version", ["1", "2"])
def test_ses_permanent_bounce_is_a_hard_bounce_per_recipient(version: str) -> None:
    fetch = Certificates()
    events = events_of(ses(sns_notification(ses_bounce(), version=version), fetch=fetch))
    assert fetch.fetched == [CERT_URL]
    assert [(e.kind, e.email) for e in events] == [
        ("hard_bounce", "ann@example.com"),
        ("hard_bounce", "Bob@Example.NET"),
    ]
    first = events[0]
    assert first.provider == "ses"
    assert first.event_id == "95df01b4-ee98-5cb9-9903-4c221d41eb5e:ann@example.com"
    assert events[1].event_id != first.event_id
    assert first.job_id == JOB
    assert first.provider_message_id == "0100018e0f9a5ca3-93c245fe-e333-46ae-8fed-96160d20cfab-000000"
    assert first.occurred_at == datetime(2026, 3, 1, 11, 58, 2, 669000, tzinfo=UTC)
    assert first.detail["bounce_type"] == "Permanent"
    assert first.detail["status"] == "5.1.1"
    assert first.detail["diagnostic_code"] == "smtp; 550 5.1.1 user unknown"


@pytest.mark.parametrize("bounce_type", ["Transient", "Undetermined"])
def test_ses_transient_and_undetermined_bounces_are_soft(bounce_type: str) -> None:
    events = events_of(ses(sns_notification(ses_bounce(bounce_type))))
    assert {e.kind for e in events} == {"soft_bounce"}


def test_ses_event_publishing_complaint_takes_the_job_id_from_the_tag() -> None:
    events = events_of(ses(sns_notification(ses_complaint_event(), version="2")))
    assert [(e.kind, e.email, e.job_id) for e in events] == [("complaint", "ann@example.com", "signup_7")]
    assert events[0].detail == {
        "feedback_type": "abuse",
        "feedback_id": "0100018e0f9a6479-2f8b9a1c-complaint-000000",
    }


def test_ses_a_not_spam_report_is_not_a_complaint() -> None:
    # RFC 5965 "not-spam": the reporter says the message is not spam (correcting an earlier report);
    # it was taken for a complaint, and the address suppressed.
    record = ses_complaint_event()
    record["complaint"]["complaintFeedbackType"] = "not-spam"
    events = events_of(ses(sns_notification(record, version="2")))
    assert [(e.kind, e.detail["feedback_type"]) for e in events] == [("other", "not-spam")]


def test_ses_delivery_and_a_signed_subject() -> None:
    events = events_of(ses(sns_notification(ses_delivery(), subject="Amazon SES Email Event Notification")))
    assert [(e.kind, e.email, e.job_id) for e in events] == [("delivered", "ann@example.com", JOB)]
    assert events[0].detail["smtp_response"] == "250 ok: Message 64111812 accepted"


def test_ses_other_records_and_the_setup_notice_are_other() -> None:
    opened = {
        "eventType": "Open",
        "mail": ses_mail(destination=["ann@example.com"]),
        "open": {"ipAddress": "192.0.2.1"},
    }
    assert [(e.kind, e.email) for e in events_of(ses(sns_notification(opened)))] == [("other", "ann@example.com")]
    setup = {"notificationType": "AmazonSnsSubscriptionSucceeded", "message": "You have successfully subscribed"}
    events = events_of(ses(sns_notification(setup)))
    assert [(e.kind, e.email, e.job_id) for e in events] == [("other", None, None)]


@pytest.mark.parametrize(("unsubscribe_all", "kind"), [(True, "unsubscribe"), (False, "other")])
def test_ses_a_subscription_event_that_leaves_every_topic_is_an_opt_out(unsubscribe_all: bool, kind: str) -> None:
    # SES list management (its own unsubscribe link): leaving every topic is an opt-out; one topic of
    # SES's contact list is not one of sendonce's lists, and is recorded only.
    record = {
        "eventType": "Subscription",
        "mail": ses_mail(destination=["ann@example.com"]),
        "subscription": {
            "contactList": "news",
            "timestamp": "2026-03-01T12:00:00.000Z",
            "source": "UnsubscribeHeader",
            "newTopicPreferences": {"unsubscribeAll": unsubscribe_all, "topicSubscriptionStatus": []},
            "oldTopicPreferences": {"unsubscribeAll": False, "topicSubscriptionStatus": []},
        },
    }
    (event,) = events_of(ses(sns_notification(record)))
    assert (event.kind, event.email, event.job_id) == (kind, "ann@example.com", JOB)


def test_ses_replay_yields_the_same_event_ids() -> None:
    body = json.dumps(sns_notification(ses_bounce())).encode()
    assert ses(body) == ses(body)


@pytest.mark.parametrize(
    "url",
    [
        "http://sns.us-east-1.amazonaws.com/SimpleNotificationService-x.pem",
        "https://sns.us-east-1.amazonaws.com.evil.example/SimpleNotificationService-x.pem",
        "https://evil.example/SimpleNotificationService-x.pem",
        "https://sns.us-east-1.amazonaws.com@evil.example/x.pem",
        "https://evil.example\\@sns.us-east-1.amazonaws.com/x.pem",
        "https://sns.us-east-1.amazonaws.com:8443/SimpleNotificationService-x.pem",
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-x.txt",
        "https://sns.us-east-1.amazonaws.com/x.pem?redirect=https://evil.example/x.pem",
        "https://s3.amazonaws.com/x.pem",
        "file:///etc/ssl/x.pem",
    ],
)
def test_ses_certificate_urls_outside_sns_are_refused_before_any_fetch(url: str) -> None:
    with pytest.raises(SignatureError, match="SigningCertURL"):
        ses(sns_notification(ses_bounce(), cert_url=url), fetch=no_fetch)


def test_ses_host_pattern_must_match_the_whole_host() -> None:
    unanchored = WebhookConfig(sns_cert_host_pattern=r"sns\.[a-z0-9-]+\.amazonaws\.com")
    url = "https://sns.us-east-1.amazonaws.com.evil.example/SimpleNotificationService-x.pem"
    with pytest.raises(SignatureError, match="not an Amazon SNS host"):
        ses(sns_notification(ses_bounce(), cert_url=url), unanchored, fetch=no_fetch)
    assert ses(sns_notification(ses_bounce()), unanchored)


def test_ses_china_regions_are_sns_hosts() -> None:
    url = "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-x.pem"
    events = events_of(ses(sns_notification(ses_bounce(), cert_url=url), fetch=Certificates({url: SNS_CERT})))
    assert len(events) == 2


def test_ses_tampered_message_or_signature_is_refused() -> None:
    envelope = sns_notification(ses_bounce("Transient"))
    tampered = dict(envelope, Message=envelope["Message"].replace("Transient", "Permanent"))
    with pytest.raises(SignatureError, match="invalid"):
        ses(tampered)
    signature = bytearray(base64.b64decode(envelope["Signature"]))
    signature[10] ^= 1
    with pytest.raises(SignatureError, match="invalid"):
        ses(dict(envelope, Signature=base64.b64encode(bytes(signature)).decode()))
    with pytest.raises(SignatureError, match="base64"):
        ses(dict(envelope, Signature="not base64!"))
    with pytest.raises(SignatureError, match="invalid"):
        ses(dict(envelope, Subject="added after signing"))
    with pytest.raises(SignatureError, match="SignatureVersion"):
        ses(dict(envelope, SignatureVersion="3"))


def test_ses_a_signature_by_another_key_is_refused() -> None:
    with pytest.raises(SignatureError, match="invalid"):
        ses(sns_notification(ses_bounce(), key=_rsa_key()))


def test_ses_expired_or_not_yet_valid_certificate_is_refused() -> None:
    expired = sns_certificate(SNS_KEY, not_before=NOW - timedelta(days=400), not_after=NOW - timedelta(seconds=1))
    with pytest.raises(SignatureError, match="not valid now"):
        ses(sns_notification(ses_bounce()), fetch=Certificates({CERT_URL: expired}))
    future = sns_certificate(SNS_KEY, not_before=NOW + timedelta(hours=1), not_after=NOW + timedelta(days=30))
    with pytest.raises(SignatureError, match="not valid now"):
        ses(sns_notification(ses_bounce()), fetch=Certificates({CERT_URL: future}))
    with pytest.raises(SignatureError, match="PEM"):
        ses(sns_notification(ses_bounce()), fetch=Certificates({CERT_URL: b"<html>not a certificate</html>"}))


def test_ses_topics_outside_the_allowlist_are_refused_before_any_fetch() -> None:
    config = WebhookConfig(sns_topic_arns=frozenset({"arn:aws:sns:us-east-1:123456789012:other"}))
    with pytest.raises(SignatureError, match="TopicArn"):
        ses(sns_notification(ses_bounce()), config, fetch=no_fetch)
    assert ses(sns_notification(ses_bounce()), WebhookConfig(sns_topic_arns=frozenset({TOPIC})))


def test_ses_subscription_and_unsubscribe_confirmations() -> None:
    headers = {"X-Amz-Sns-Message-Type": "SubscriptionConfirmation"}
    result = ses(sns_confirmation(), headers=headers)
    assert isinstance(result, SubscriptionConfirmation)
    assert result.topic_arn == TOPIC
    assert result.subscribe_url.startswith("https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription")
    assert result.message_type == "SubscriptionConfirmation"
    result = ses(sns_confirmation("UnsubscribeConfirmation"), headers={})
    assert isinstance(result, SubscriptionConfirmation)
    assert result.message_type == "UnsubscribeConfirmation"
    with pytest.raises(SignatureError, match="invalid"):  # the Token is signed
        ses(dict(sns_confirmation(), Token="forged"), headers={})
    # A signed SubscribeURL is still only followed to an SNS host.
    with pytest.raises(PayloadError, match="SubscribeURL"):
        ses(sns_confirmation(SubscribeURL="https://evil.example/?Action=ConfirmSubscription"), headers={})


def test_ses_a_lone_surrogate_in_a_signed_field_is_a_payload_error() -> None:
    # JSON can spell a lone surrogate ("\\ud800"); no signed SNS text holds one. It was a
    # UnicodeEncodeError out of the parser (a 422 from the app's fallback), not a refused webhook.
    body = json.dumps(sns_notification(ses_delivery())).replace(
        '"Type": "Notification"', '"Type": "Notification", "Subject": "\\ud800"'
    )
    with pytest.raises(PayloadError, match="not valid Unicode"):
        ses(body.encode())


def test_ses_malformed_payloads_are_payload_errors() -> None:
    with pytest.raises(PayloadError, match="not valid JSON"):
        ses(b"{not json")
    with pytest.raises(PayloadError, match="must be an object"):
        ses(b"[]")
    with pytest.raises(PayloadError, match="Type is missing"):
        ses({"MessageId": "x"})
    with pytest.raises(PayloadError, match="not an SNS message type"):
        ses(dict(sns_notification(ses_bounce()), Type="Surprise"), headers={})
    with pytest.raises(PayloadError, match="does not match"):
        ses(sns_notification(ses_bounce()), headers={"x-amz-sns-message-type": "SubscriptionConfirmation"})
    with pytest.raises(PayloadError, match="Message is not valid JSON"):
        ses(sns_notification("this is not JSON"))
    record = ses_bounce()
    record["bounce"]["bouncedRecipients"] = {"emailAddress": "ann@example.com"}
    with pytest.raises(PayloadError, match=r"Message\.bounce\.bouncedRecipients must be an array"):
        ses(sns_notification(record))
    record = ses_bounce()
    del record["bounce"]["bouncedRecipients"][1]["emailAddress"]
    with pytest.raises(PayloadError, match=r"bouncedRecipients\[1\]\.emailAddress is missing"):
        ses(sns_notification(record))
    with pytest.raises(PayloadError, match=r"Message\.mail is missing"):
        ses(sns_notification({"notificationType": "Bounce", "bounce": ses_bounce()["bounce"]}))


# == Resend (svix) ================================================================================


def resend_bounce(bounce_type: str = "Permanent") -> dict[str, Any]:
    """The email.bounced example of Resend's documentation, plus our header echoed back."""
    return {
        "type": "email.bounced",
        "created_at": "2026-03-01T11:59:12.126Z",
        "data": {
            "broadcast_id": "8b146471-e88e-4322-86af-016cd36fd216",
            "created_at": "2026-03-01T11:59:11.894719+00:00",
            "email_id": "56761188-7520-42d8-8898-ff6fc54ce618",
            "from": "Acme <onboarding@resend.dev>",
            "to": ["ann@example.com"],
            "subject": "Sending this example",
            "headers": {"Sendonce-Job-Id": JOB},
            "bounce": {
                "message": "The recipient's email address is on the suppression list because it has a recent "
                "history of producing hard bounces.",
                "subType": "Suppressed",
                "type": bounce_type,
            },
            "tags": {"category": "confirm_email"},
        },
    }


def resend(body: bytes, headers: dict[str, str] | None = None, config: WebhookConfig | None = None, **kw: Any) -> Any:
    config = config or WebhookConfig(resend_secret=SVIX_SECRET)
    headers = svix_headers(body, ts=TS) if headers is None else headers
    return parse_webhook("resend", headers, body, config, now=kw.get("now", NOW), fetch_certificate=no_fetch)


def test_resend_accepts_the_published_standard_webhooks_vector() -> None:
    body = b'{"test": 2432232314}'
    headers = {
        "svix-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "svix-timestamp": "1614265330",
        "svix-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    }
    config = WebhookConfig(resend_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    now = datetime.fromtimestamp(1614265330, UTC)
    # The signature verifies; the body is no Resend event, which is the payload's fault.
    with pytest.raises(PayloadError, match="type is missing"):
        resend(body, headers, config, now=now)
    with pytest.raises(SignatureError, match="invalid"):
        resend(body.replace(b"2", b"3"), headers, config, now=now)


def test_resend_bounce_is_parsed() -> None:
    body = json.dumps(resend_bounce()).encode()
    (event,) = events_of(resend(body))
    assert event == FeedbackEvent(
        provider="resend",
        event_id="msg_2p5Qx0w1",
        kind="hard_bounce",
        email="ann@example.com",
        job_id=JOB,
        provider_message_id="56761188-7520-42d8-8898-ff6fc54ce618",
        occurred_at=datetime(2026, 3, 1, 11, 59, 12, 126000, tzinfo=UTC),
        detail={
            "bounce_type": "Permanent",
            "bounce_subtype": "Suppressed",
            "message": resend_bounce()["data"]["bounce"]["message"],
        },
    )
    assert resend(body) == [event]  # a replay: same event id


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [("email.complained", "complaint"), ("email.delivered", "delivered"), ("email.opened", "other")],
)
def test_resend_other_event_types(event_type: str, kind: str) -> None:
    payload = resend_bounce()
    payload["type"] = event_type
    del payload["data"]["bounce"], payload["data"]["headers"]
    payload["data"]["tags"] = [{"name": "sendonce_job_id", "value": "signup_9"}]
    (event,) = events_of(resend(json.dumps(payload).encode()))
    assert (event.kind, event.email, event.job_id) == (kind, "ann@example.com", "signup_9")


def test_resend_transient_bounce_is_soft_and_several_recipients_get_distinct_ids() -> None:
    payload = resend_bounce("Transient")
    payload["data"]["to"] = ["ann@example.com", "bob@example.net"]
    events = events_of(resend(json.dumps(payload).encode()))
    assert [(e.kind, e.email, e.event_id) for e in events] == [
        ("soft_bounce", "ann@example.com", "msg_2p5Qx0w1:ann@example.com"),
        ("soft_bounce", "bob@example.net", "msg_2p5Qx0w1:bob@example.net"),
    ]


def test_resend_header_names_are_case_insensitive_and_rotation_signatures_are_tried() -> None:
    body = json.dumps(resend_bounce()).encode()
    good = svix_headers(body, ts=TS)
    headers = {
        "Svix-Id": good["svix-id"],
        "SVIX-TIMESTAMP": good["svix-timestamp"],
        "Svix-Signature": "v1,b2xkLXNpZ25hdHVyZQ== v1a,c29tZXRoaW5n " + good["svix-signature"],
    }
    assert events_of(resend(body, headers))[0].event_id == "msg_2p5Qx0w1"


def test_resend_refuses_tampering_staleness_and_missing_parts() -> None:
    body = json.dumps(resend_bounce("Transient")).encode()
    headers = svix_headers(body, ts=TS)
    with pytest.raises(SignatureError, match="invalid"):
        resend(body.replace(b"Transient", b"Permanent"), headers)
    with pytest.raises(SignatureError, match="invalid"):
        resend(body, dict(headers, **{"svix-id": "msg_other"}))
    with pytest.raises(SignatureError, match="invalid"):
        resend(body, svix_headers(body, ts=TS, key=b"another key entirely, 32 bytes!!"))
    with pytest.raises(SignatureError, match="invalid"):
        resend(body, dict(headers, **{"svix-signature": headers["svix-signature"].replace("v1,", "v2,")}))
    stale = str(int(NOW.timestamp()) - 301)
    with pytest.raises(SignatureError, match="too old"):
        resend(body, svix_headers(body, ts=stale))
    future = str(int(NOW.timestamp()) + 301)
    with pytest.raises(SignatureError, match="future"):
        resend(body, svix_headers(body, ts=future))
    with pytest.raises(SignatureError, match="not a unix timestamp"):
        resend(body, svix_headers(body, ts="2026-03-01T12:00:00Z"))
    for name in ("svix-id", "svix-timestamp", "svix-signature"):
        partial = {k: v for k, v in headers.items() if k != name}
        with pytest.raises(SignatureError, match=f"no {name} header"):
            resend(body, partial)
    with pytest.raises(SignatureError, match="webhook secret for resend is not configured"):
        resend(body, headers, WebhookConfig())
    with pytest.raises(SignatureError, match="not a valid whsec_"):
        resend(body, headers, WebhookConfig(resend_secret="whsec_###"))


def test_resend_malformed_payloads_are_payload_errors() -> None:
    for body, message in [
        (b"not json", "not valid JSON"),
        (b'"a string"', "must be an object"),
        (b'{"type": "email.bounced"}', "data is missing"),
        (b'{"type": 7, "data": {}}', "type must be a string, not a number"),
        (b'{"type": "email.bounced", "data": {"to": [1]}}', r"data\.to\[0\] must be a string"),
        (b'{"type": "email.bounced", "created_at": "yesterday", "data": {}}', "created_at is not an ISO-8601"),
        (b'{"type": "email.bounced", "data": {"bounce": []}}', r"data\.bounce must be an object"),
        (b'{"type": "email.bounced", "data": {"to": ["a@b.c"], "x": NaN}}', "NaN is not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON"),
    ]:
        with pytest.raises(PayloadError, match=message):
            resend(body)


# == Postmark =====================================================================================


def postmark_bounce(bounce_type: str = "HardBounce", record_type: str = "Bounce") -> dict[str, Any]:
    """The bounce webhook example of Postmark's documentation, with our job id in Metadata."""
    return {
        "RecordType": record_type,
        "MessageStream": "outbound",
        "ID": 4323372036854775807,
        "Type": bounce_type,
        "TypeCode": 1,
        "Name": "Hard bounce",
        "Tag": "Test",
        "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483",
        "Metadata": {"sendonce-job-id": JOB, "b_key": "b_value"},
        "ServerID": 23,
        "Description": "The server was unable to deliver your message (ex: unknown user, mailbox not found).",
        "Details": "Test bounce details",
        "Email": "john@example.com",
        "From": "sender@example.com",
        "BouncedAt": "2026-03-01T06:33:54.9070259-05:00",
        "DumpAvailable": True,
        "Inactive": True,
        "CanActivate": True,
        "Subject": "Test subject",
        "Content": "Test content",
    }


def postmark_delivery() -> dict[str, Any]:
    return {
        "RecordType": "Delivery",
        "ServerID": 23,
        "MessageStream": "outbound",
        "MessageID": "00000000-0000-0000-0000-000000000000",
        "Recipient": "john@example.com",
        "Tag": "welcome-email",
        "DeliveredAt": "2026-03-01T11:33:54.9070259Z",
        "Details": "Test delivery webhook details",
        "Metadata": {"sendonce_job_id": "signup_3"},
    }


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def postmark(payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    config = kw.get("config", WebhookConfig(postmark_token=POSTMARK_TOKEN))
    headers = basic("postmark", POSTMARK_TOKEN) if headers is None else headers
    return parse_webhook("postmark", headers, body, config, now=NOW, fetch_certificate=no_fetch)


def test_postmark_hard_bounce_is_parsed() -> None:
    (event,) = events_of(postmark(postmark_bounce()))
    assert (event.kind, event.email, event.job_id) == ("hard_bounce", "john@example.com", JOB)
    assert event.event_id == "4323372036854775807"
    assert event.provider_message_id == "883953f4-6105-42a2-a16a-77a8eac79483"
    assert event.occurred_at == datetime(2026, 3, 1, 11, 33, 54, 907025, tzinfo=UTC)
    assert event.detail["type"] == "HardBounce"
    assert event.detail["inactive"] is True
    assert postmark(postmark_bounce()) == [event]  # a replay: same event id


@pytest.mark.parametrize(
    ("record_type", "bounce_type", "kind"),
    [
        ("Bounce", "SoftBounce", "soft_bounce"),
        ("Bounce", "Transient", "soft_bounce"),
        ("Bounce", "DnsError", "soft_bounce"),
        ("Bounce", "SpamNotification", "soft_bounce"),
        ("Bounce", "BadEmailAddress", "hard_bounce"),
        ("Bounce", "SpamComplaint", "complaint"),
        ("SpamComplaint", "SpamComplaint", "complaint"),
        ("Bounce", "AutoResponder", "other"),
        ("Bounce", "SomethingNew", "other"),
    ],
)
def test_postmark_bounce_types(record_type: str, bounce_type: str, kind: str) -> None:
    (event,) = events_of(postmark(postmark_bounce(bounce_type, record_type)))
    assert event.kind == kind


@pytest.mark.parametrize(
    ("suppress", "reason", "kind"),
    [
        (True, "ManualSuppression", "unsubscribe"),  # its unsubscribe link, or by hand
        (True, "HardBounce", "hard_bounce"),
        (True, "SpamComplaint", "complaint"),
        (True, None, "unsubscribe"),
        (False, None, "other"),  # sending resumed: lifting a suppression is the account's act
    ],
)
def test_postmark_a_subscription_change_that_stops_sending_is_an_opt_out(
    suppress: bool, reason: str | None, kind: str
) -> None:
    change = {
        "RecordType": "SubscriptionChange",
        "MessageID": "00000000-0000-0000-0000-000000000000",
        "Recipient": "john@example.com",
        "ChangedAt": "2026-03-01T11:40:00Z",
        "SuppressSending": suppress,
        "SuppressionReason": reason,
        "Metadata": {"sendonce-job-id": JOB},
    }
    (event,) = events_of(postmark(change))
    assert (event.kind, event.email, event.job_id) == (kind, "john@example.com", JOB)


def test_postmark_an_unsubscribe_request_bounce_is_an_opt_out() -> None:
    (event,) = events_of(postmark(postmark_bounce("Unsubscribe")))
    assert event.kind == "unsubscribe"


def test_postmark_delivery_and_the_token_header() -> None:
    (event,) = events_of(postmark(postmark_delivery(), {"X-Sendonce-Webhook-Token": POSTMARK_TOKEN}))
    assert (event.kind, event.email, event.job_id) == ("delivered", "john@example.com", "signup_3")
    assert event.event_id == "00000000-0000-0000-0000-000000000000:Delivery"


def test_postmark_opens_get_one_id_per_open() -> None:
    opened = {
        "RecordType": "Open",
        "MessageID": "00000000-0000-0000-0000-000000000000",
        "Recipient": "john@example.com",
        "ReceivedAt": "2026-03-01T11:40:00Z",
        "FirstOpen": True,
    }
    again = dict(opened, ReceivedAt="2026-03-01T11:50:00Z", FirstOpen=False)
    assert events_of(postmark(opened))[0].event_id != events_of(postmark(again))[0].event_id


def test_postmark_job_id_from_a_headers_list() -> None:
    record = postmark_bounce()
    del record["Metadata"]
    record["Headers"] = [{"Name": "X-Other", "Value": "1"}, {"Name": "Sendonce-Job-Id", "Value": JOB}]
    assert events_of(postmark(record))[0].job_id == JOB


def test_postmark_refuses_missing_or_wrong_tokens() -> None:
    record = postmark_bounce()
    with pytest.raises(SignatureError, match="invalid"):
        postmark(record, basic("postmark", POSTMARK_TOKEN + "x"))
    with pytest.raises(SignatureError, match="invalid"):
        postmark(record, {"x-sendonce-webhook-token": "guess"})
    with pytest.raises(SignatureError, match="missing"):
        postmark(record, {})
    with pytest.raises(SignatureError, match="missing"):
        postmark(record, {"Authorization": "Bearer " + POSTMARK_TOKEN})
    with pytest.raises(SignatureError, match="missing"):  # a Basic header that does not decode offers nothing
        postmark(record, {"Authorization": "Basic !!!"})
    with pytest.raises(SignatureError, match="missing"):  # nor one without a colon
        postmark(record, {"Authorization": "Basic " + base64.b64encode(POSTMARK_TOKEN.encode()).decode()})
    with pytest.raises(SignatureError, match="webhook secret for postmark is not configured"):
        postmark(record, config=WebhookConfig())
    # The user name does not matter; the password does.
    assert postmark(record, basic("anyone", POSTMARK_TOKEN))


def test_postmark_a_broken_basic_header_does_not_hide_a_right_token() -> None:
    # A proxy in front may add an Authorization header of its own: the request was refused (401,
    # and Postmark gave the bounce up) although it carried the right token in the header.
    headers = {"Authorization": "Basic not-base64!", "X-Sendonce-Webhook-Token": POSTMARK_TOKEN}
    assert events_of(postmark(postmark_bounce(), headers))[0].kind == "hard_bounce"
    with pytest.raises(SignatureError, match="invalid"):
        postmark(postmark_bounce(), {**headers, "X-Sendonce-Webhook-Token": "guess"})


def test_postmark_malformed_payloads_are_payload_errors() -> None:
    with pytest.raises(PayloadError, match="not valid JSON"):
        postmark(b"<xml/>")
    with pytest.raises(PayloadError, match="RecordType is missing"):
        postmark({"Type": "HardBounce"})
    with pytest.raises(PayloadError, match="not a Postmark webhook record type"):
        postmark({"RecordType": "Carrier pigeon"})
    record = postmark_bounce()
    del record["ID"]
    with pytest.raises(PayloadError, match="ID is missing"):
        postmark(record)
    with pytest.raises(PayloadError, match="ID must be a string or a number"):
        postmark(dict(postmark_bounce(), ID=True))
    with pytest.raises(PayloadError, match="Email must be a string"):
        postmark(dict(postmark_bounce(), Email=["john@example.com"]))
    with pytest.raises(PayloadError, match="Metadata must be an object"):
        postmark(dict(postmark_bounce(), Metadata="x"))
    with pytest.raises(PayloadError, match="Recipient is missing"):
        postmark({k: v for k, v in postmark_delivery().items() if k != "Recipient"})


# == SendGrid =====================================================================================


def sendgrid_event(event: str, sg_event_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "email": "example@test.com",
        "timestamp": 1772366300,
        "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
        "event": event,
        "category": "cat facts",
        "sg_event_id": sg_event_id,
        "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "sendonce_job_id": JOB,
        **extra,
    }


SENDGRID_BATCH = [
    sendgrid_event("bounce", "6g4ZI7SA-xmRDv57GoPIPw==", reason="500 unknown recipient", status="5.0.0", type="bounce"),
    sendgrid_event(
        "bounce", "7h5AJ8TB-ynSEw68HpQJQx==", reason="550 blocked by policy", status="5.7.1", type="blocked"
    ),
    sendgrid_event("dropped", "zmzJhfJgAfUSOW80yEbPyw==", reason="Bounced Address", status="5.0.0"),
    sendgrid_event("dropped", "Aa1Bb2Cc3Dd4Ee5Ff6Gg7w==", reason="Invalid SMTPAPI header"),
    sendgrid_event("spamreport", "37nvH5QBz858KGVYCM4uOA=="),
    sendgrid_event("delivered", "rWVYmVk90MjZJ9iohOBa3w==", response="250 OK"),
    sendgrid_event("deferred", "t7LEShmowp86DTdUW8M-GQ==", response="400 try again later", attempt="5"),
    sendgrid_event("open", "FOTFFO0ecsBE-zxFXfs6WA==", useragent="Mozilla/4.0", ip="192.0.2.1"),
]


def sendgrid(body: bytes, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    config = kw.get("config", WebhookConfig(sendgrid_public_key=SENDGRID_PUBLIC))
    headers = sendgrid_headers(body, ts=TS) if headers is None else headers
    return parse_webhook("sendgrid", headers, body, config, now=kw.get("now", NOW), fetch_certificate=no_fetch)


def test_sendgrid_batch_is_parsed() -> None:
    body = json.dumps(SENDGRID_BATCH).encode()
    events = events_of(sendgrid(body))
    assert [e.kind for e in events] == [
        "hard_bounce",
        "soft_bounce",
        "hard_bounce",
        "other",
        "complaint",
        "delivered",
        "other",
        "other",
    ]
    first = events[0]
    assert (first.event_id, first.email, first.job_id) == ("6g4ZI7SA-xmRDv57GoPIPw==", "example@test.com", JOB)
    assert first.provider_message_id == "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0"
    assert first.occurred_at == datetime.fromtimestamp(1772366300, UTC)
    assert first.detail == {"event": "bounce", "type": "bounce", "reason": "500 unknown recipient", "status": "5.0.0"}
    assert sendgrid(body) == events  # a replay: same event ids


@pytest.mark.parametrize(
    ("event", "extra", "kind"),
    [
        ("unsubscribe", {}, "unsubscribe"),
        ("group_unsubscribe", {"asm_group_id": 10}, "unsubscribe"),
        ("group_resubscribe", {"asm_group_id": 10}, "other"),
        ("dropped", {"reason": "Unsubscribed Address"}, "unsubscribe"),
        ("dropped", {"reason": "Spam Reporting Address"}, "complaint"),
    ],
)
def test_sendgrid_opt_outs_it_took_are_opt_outs(event: str, extra: dict[str, Any], kind: str) -> None:
    # SendGrid's own unsubscribe link (subscription tracking, unsubscribe groups), and the mail it drops
    # for its lists: these were "other", and the subscriber stayed confirmed.
    (parsed,) = events_of(sendgrid(json.dumps([sendgrid_event(event, "u1", **extra)]).encode()))
    assert (parsed.kind, parsed.email, parsed.job_id) == (kind, "example@test.com", JOB)


def test_sendgrid_accepts_the_published_vector_and_a_pem_key() -> None:
    # The test vector of SendGrid's own helper libraries: the signature verifies, the body is no batch.
    public_key = (
        "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEEDr2LjtURuePQzplybdC+u4CwrqDqBaWjcMMsTbhdbcwHBcepxo7yAQGhHPTnlvFYPAZFceEu/"
        "1FwCM/QmGUhA=="
    )
    headers = {
        "X-Twilio-Email-Event-Webhook-Signature": "MEUCIQCtIHJeH93Y+qpYeWrySphQgpNGNr/U+UyUlBkU6n7RAwIgJTz2C+8a8xonZGi6"
        "BpSzoQsbVRamr2nlxFDWYNH2j/0=",
        "X-Twilio-Email-Event-Webhook-Timestamp": "1588788367",
    }
    body = b'{"category":"example_payload","event":"test_event","message_id":"message_id"}'
    config = WebhookConfig(sendgrid_public_key=public_key)
    now = datetime.fromtimestamp(1588788367, UTC)
    with pytest.raises(PayloadError, match="must be an array"):
        sendgrid(body, headers, config=config, now=now)
    with pytest.raises(SignatureError, match="invalid"):
        sendgrid(body.replace(b"example", b"forged!"), headers, config=config, now=now)

    pem = SENDGRID_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    body = json.dumps(SENDGRID_BATCH[:1]).encode()
    assert len(sendgrid(body, config=WebhookConfig(sendgrid_public_key=pem.decode()))) == 1


def test_sendgrid_refuses_tampering_staleness_and_bad_keys() -> None:
    body = json.dumps(SENDGRID_BATCH[:2]).encode()
    headers = sendgrid_headers(body, ts=TS)
    with pytest.raises(SignatureError, match="invalid"):
        sendgrid(body.replace(b'"blocked"', b'"bounce"'), headers)
    with pytest.raises(SignatureError, match="invalid"):
        sendgrid(body, sendgrid_headers(body, ts=TS, key=ec.generate_private_key(ec.SECP256R1())))
    with pytest.raises(SignatureError, match="invalid"):  # the timestamp is signed too
        sendgrid(body, dict(headers, **{"X-Twilio-Email-Event-Webhook-Timestamp": str(int(TS) + 1)}))
    with pytest.raises(SignatureError, match="base64"):
        sendgrid(body, dict(headers, **{"X-Twilio-Email-Event-Webhook-Signature": "%%%"}))
    with pytest.raises(SignatureError, match="too old"):
        sendgrid(body, sendgrid_headers(body, ts=str(int(TS) - 3600)))
    with pytest.raises(SignatureError, match="no x-twilio-email-event-webhook-signature header"):
        sendgrid(body, {"X-Twilio-Email-Event-Webhook-Timestamp": TS})
    with pytest.raises(SignatureError, match="webhook secret for sendgrid is not configured"):
        sendgrid(body, headers, config=WebhookConfig())
    with pytest.raises(SignatureError, match="not a valid public key"):
        sendgrid(body, headers, config=WebhookConfig(sendgrid_public_key="bm90IGEga2V5"))
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    der = p384.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(SignatureError, match="P-256"):
        sendgrid(body, headers, config=WebhookConfig(sendgrid_public_key=base64.b64encode(der).decode()))


def test_sendgrid_malformed_payloads_are_payload_errors() -> None:
    for batch, message in [
        ({"event": "bounce"}, "must be an array"),
        ([7], r"\[0\] must be an object"),
        ([{k: v for k, v in SENDGRID_BATCH[0].items() if k != "sg_event_id"}], r"\[0\]\.sg_event_id is missing"),
        ([SENDGRID_BATCH[0], dict(SENDGRID_BATCH[1], timestamp="yesterday")], r"\[1\]\.timestamp must be a unix"),
        ([dict(SENDGRID_BATCH[0], email=None)], r"\[0\]\.email is missing"),
        ([dict(SENDGRID_BATCH[0], sendonce_job_id={"a": 1})], r"\[0\]\.sendonce_job_id must be a string"),
    ]:
        with pytest.raises(PayloadError, match=message):
            sendgrid(json.dumps(batch).encode())


# == generic ======================================================================================

GENERIC_PAYLOAD: dict[str, Any] = {
    "events": [
        {
            "id": "evt-1",
            "type": "hard_bounce",
            "email": "ann@example.com",
            "job_id": JOB,
            "occurred_at": "2026-03-01T12:59:00+01:00",
            "detail": {"smtp_status": "5.1.1", "diagnostic": "550 no such user"},
        },
        {"id": "evt-2", "type": "soft_bounce", "email": "bob@example.net"},
        {"id": "evt-3", "type": "complaint", "email": "cy@example.org", "job_id": None},
        {"id": "evt-4", "type": "delivered", "email": "dee@example.org", "occurred_at": "2026-03-01T11:00:00Z"},
    ]
}


def generic(payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    config = kw.get("config", WebhookConfig(generic_secret=GENERIC_SECRET))
    headers = generic_headers(body, ts=TS) if headers is None else headers
    return parse_webhook("generic", headers, body, config, now=NOW, fetch_certificate=no_fetch)


def test_generic_events_are_parsed() -> None:
    events = events_of(generic(GENERIC_PAYLOAD))
    assert [(e.event_id, e.kind, e.email, e.job_id) for e in events] == [
        ("evt-1", "hard_bounce", "ann@example.com", JOB),
        ("evt-2", "soft_bounce", "bob@example.net", None),
        ("evt-3", "complaint", "cy@example.org", None),
        ("evt-4", "delivered", "dee@example.org", None),
    ]
    assert events[0].occurred_at == datetime(2026, 3, 1, 11, 59, tzinfo=UTC)
    assert events[0].detail == {"smtp_status": "5.1.1", "diagnostic": "550 no such user"}
    assert events[1].occurred_at is None and events[1].detail == {}
    assert {e.provider for e in events} == {"generic"}
    assert generic(GENERIC_PAYLOAD) == events  # a replay: same event ids
    assert generic({"events": []}) == []


def test_generic_refuses_tampering_staleness_and_missing_parts() -> None:
    body = json.dumps(GENERIC_PAYLOAD).encode()
    headers = generic_headers(body, ts=TS)
    with pytest.raises(SignatureError, match="invalid"):
        generic(body.replace(b"soft_bounce", b"hard_bounce"), headers)
    with pytest.raises(SignatureError, match="invalid"):
        generic(body, generic_headers(body, ts=TS, secret="not the secret"))
    with pytest.raises(SignatureError, match="invalid"):  # the timestamp is inside the MAC
        generic(body, dict(headers, **{"Sendonce-Timestamp": str(int(TS) - 1)}))
    with pytest.raises(SignatureError, match="too old"):
        generic(body, generic_headers(body, ts=str(int(TS) - 301)))
    with pytest.raises(SignatureError, match="sha256="):
        generic(body, dict(headers, **{"Sendonce-Signature": headers["Sendonce-Signature"].removeprefix("sha256=")}))
    with pytest.raises(SignatureError, match="no sendonce-timestamp header"):
        generic(body, {"Sendonce-Signature": headers["Sendonce-Signature"]})
    with pytest.raises(SignatureError, match="webhook secret for generic is not configured"):
        generic(body, headers, config=WebhookConfig())
    upper = dict(headers, **{"Sendonce-Signature": "sha256=" + headers["Sendonce-Signature"][7:].upper()})
    assert len(generic(body, upper)) == 4  # hex digits in either case


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"id": "e", "type": "bounced", "email": "a@b.c"}, r"events\[0\]\.type 'bounced' is not one of hard_bounce"),
        ({"id": "e", "type": "other", "email": "a@b.c"}, "is not one of"),
        ({"type": "complaint", "email": "a@b.c"}, r"events\[0\]\.id is missing"),
        ({"id": "", "type": "complaint", "email": "a@b.c"}, r"events\[0\]\.id is empty"),
        ({"id": 5, "type": "complaint", "email": "a@b.c"}, "id must be a string, not a number"),
        ({"id": "e", "type": "complaint"}, r"events\[0\]\.email is missing"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "ocurred_at": "x"}, "unknown field.*'ocurred_at'"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "occurred_at": "2026-03-01T11:00:00"}, "UTC offset"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "occurred_at": "soon"}, "not an ISO-8601"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "detail": ["x"]}, "detail must be an object"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "detail": {"x": "y" * 5000}}, "larger than"),
        ({"id": "e", "type": "complaint", "email": "a@b.c", "job_id": 7}, "job_id must be a string"),
        ({"id": "e" * 201, "type": "complaint", "email": "a@b.c"}, "longer than 200"),
    ],
)
def test_generic_validates_strictly(event: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        generic({"events": [event]})


def test_generic_payload_shape_errors() -> None:
    with pytest.raises(PayloadError, match="events is missing"):
        generic({})
    with pytest.raises(PayloadError, match="events must be an array"):
        generic({"events": {"id": "e"}})
    with pytest.raises(PayloadError, match=r"unknown field.*'event'"):
        generic({"event": []})
    duplicate = {"id": "e", "type": "complaint", "email": "a@b.c"}
    with pytest.raises(PayloadError, match="appears twice"):
        generic({"events": [duplicate, duplicate]})


# == the dispatcher ===============================================================================


def test_unknown_provider_and_naive_now() -> None:
    with pytest.raises(PayloadError, match="unknown webhook provider 'mailgun'"):
        parse_webhook("mailgun", {}, b"{}", WebhookConfig(), now=NOW, fetch_certificate=no_fetch)
    with pytest.raises(ValueError, match="timezone-aware"):
        parse_webhook("generic", {}, b"{}", WebhookConfig(), now=datetime(2026, 3, 1), fetch_certificate=no_fetch)


def test_errors_carry_their_http_status() -> None:
    assert SignatureError("x").status == 401
    assert PayloadError("x").status == 400
    assert issubclass(SignatureError, WebhookError) and issubclass(PayloadError, WebhookError)
    assert str(SignatureError()) == "The webhook signature is missing or invalid."


# == properties ===================================================================================
# Whatever a correctly signed payload holds, the parser answers with events or a PayloadError:
# never a KeyError, a TypeError or anything else that would become a 500 and a retry storm.

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _mutate(document: Any, path: tuple[Any, ...], replacement: Any, delete: bool) -> Any:
    if not path:
        return replacement
    copied = copy.deepcopy(document)
    parent = copied
    for step in path[:-1]:
        parent = parent[step]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return copied


def _sns_body(record: Any) -> bytes:
    return json.dumps(sns_notification(record if isinstance(record, dict) else json.dumps(record))).encode()


PROVIDER_CASES: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    "ses": (ses_bounce(), lambda doc: ses(_sns_body(doc), headers={})),
    "resend": (resend_bounce(), lambda doc: resend(json.dumps(doc).encode())),
    "postmark": (postmark_bounce(), lambda doc: postmark(json.dumps(doc).encode())),
    "sendgrid": (SENDGRID_BATCH, lambda doc: sendgrid(json.dumps(doc).encode())),
    "generic": (GENERIC_PAYLOAD, lambda doc: generic(json.dumps(doc).encode())),
}


@pytest.mark.parametrize("provider", sorted(PROVIDER_CASES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_of_a_signed_payload_is_parsed_or_refused_cleanly(provider: str, data: st.DataObject) -> None:
    document, parse = PROVIDER_CASES[provider]
    path = data.draw(st.sampled_from(list(_paths(document))), label="path")
    mutated = _mutate(document, path, data.draw(json_values, label="value"), data.draw(st.booleans(), label="delete"))
    try:
        result = parse(mutated)
    except PayloadError:
        return
    for event in events_of(result):
        assert event.kind in {"hard_bounce", "soft_bounce", "complaint", "delivered", "other"}
        assert isinstance(event.event_id, str) and event.event_id
        assert event.email is None or isinstance(event.email, str)
        assert event.job_id is None or isinstance(event.job_id, str)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_changed_byte_breaks_the_signature(data: st.DataObject) -> None:
    body = json.dumps(GENERIC_PAYLOAD).encode()
    index = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
    flipped = (
        body[:index] + bytes([body[index] ^ data.draw(st.integers(min_value=1, max_value=255))]) + body[index + 1 :]
    )
    with pytest.raises(SignatureError):
        generic(flipped, generic_headers(body, ts=TS))
    with pytest.raises(SignatureError):
        resend(flipped, svix_headers(body, ts=TS))
    with pytest.raises(SignatureError):
        sendgrid(flipped, sendgrid_headers(body, ts=TS))


@settings(max_examples=60, deadline=None)
@given(body=st.binary(max_size=64), provider=st.sampled_from(["resend", "postmark", "sendgrid", "generic"]))
def test_arbitrary_signed_bytes_never_escape_as_anything_but_webhook_errors(body: bytes, provider: str) -> None:
    signers: dict[str, Callable[[bytes], Any]] = {
        "resend": resend,
        "postmark": postmark,
        "sendgrid": sendgrid,
        "generic": generic,
    }
    with contextlib.suppress(PayloadError):
        events_of(signers[provider](body))


# == the documented formats =======================================================================


def test_the_documented_formats_describe_what_the_parsers_take() -> None:
    """The OpenAPI document of the webhook route describes each provider's examples above."""
    formats = {schema["title"]: schema for schema in schemas.BODIES}
    examples: dict[str, list[Any]] = {
        "generic": [GENERIC_PAYLOAD],
        "resend": [resend_bounce()],
        "postmark": [postmark_bounce(), postmark_bounce("SpamComplaint", "SpamComplaint"), postmark_delivery()],
        "sendgrid": [SENDGRID_BATCH],
        "ses": [sns_notification(ses_bounce()), sns_confirmation()],
    }
    assert set(formats) == set(examples)
    for provider, payloads in examples.items():
        validator = jsonschema_rs.validator_for(formats[provider])
        for payload in payloads:
            validator.validate(payload)
    assert not jsonschema_rs.validator_for(formats["generic"]).is_valid({"events": [], "extra": 1})
