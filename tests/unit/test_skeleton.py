"""A campaign's skeleton writes what the composer's general path writes, byte for byte, or declines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sendonce.delivery.compose import CampaignContent, Composer, Sender, _skeleton, compile_campaign
from sendonce.domain.message import OutgoingMessage, wire_content
from sendonce.store.outbox import ClaimedDelivery
from tests.helpers import composer

_TEXTS = [
    "Hello {{ name }},\n\nYour address is {{ email }}.\nRead it online: https://x.test/?s={{ subscriber.id }}\n",
    "{{ name }}\n.{{ email }}\n{{ name }}",  # values that begin lines, a static dot at a line start, no end
    "Hi {{ attributes.city }} {{ name }}\n\t{{ subscriber.attributes.city }}\r\nbye\r",  # CR line ends, a tab
    "Unsubscribe: {{ unsubscribe_url }}\n{{ campaign.name }} {{ campaign.id }} 100% =_so_",
    "x" * 960 + "{{ name }}\n",  # a line that leaves little room
    "{{ name }}.{{ email }}\n{{ unsubscribe_url }}\n{{ attributes.city }}",  # a dot after a value; one at the end
    "Caf\u00e9 {{ name }}\n",  # a static part that is not ASCII: quoted-printable, never a skeleton
    "{% if name %}{{ name }}{% endif %}\n",  # only Jinja can render it
]
_HTMLS = [
    None,
    '<html><body><p>Hello {{ name }}</p><a href="https://x.test/?s={{ subscriber.id }}">{{ email }}</a></body></html>',
    "<p>{{ name }} &amp; {{ attributes.city }}</p>\n<p>{{ unsubscribe_url }}</p>",
    "<BODY>{{ name }}</BODY><p>no closing tag</p> ",
]
_SUBJECTS = ["{{ name }}, your news", "News", "{{ email }}, {{ attributes.city }}, 100%"]
_WORDS = st.sampled_from(["", " ", ".", "..dot", "Ann", "Ann ", " Ann", "\tTab", "O'Neil & <Co>", '"q"', "=_so_"])
_VALUES = st.one_of(
    _WORDS,
    st.text(max_size=20),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.integers(),
    st.none(),
    st.floats(allow_nan=False),
    st.just("a" * 300),
)


def _campaign(text: str, html: str | None, subject: str, boundary: str) -> CampaignContent:
    subject_t, text_t, html_t = compile_campaign(subject=subject, text=text, html=html)
    content = CampaignContent(
        account_id=1,
        campaign_id=7,
        name="November <news>",
        subject=subject_t,
        text=text_t,
        html=html_t,
        from_header="Acme News <news@sender.test>",
        envelope_from="news@sender.test",
        domain="sender.test",
        boundary=boundary,
        text_shows_unsubscribe_url="unsubscribe_url" in text_t.variables,
        html_shows_unsubscribe_url=html_t is not None and "unsubscribe_url" in html_t.variables,
    )
    return replace(content, skeleton=_skeleton(content))


class _OneDate:
    """The same Date for both composers: two calls a moment apart can straddle a second."""

    def now(self) -> str:
        return "Wed, 02 Dec 2026 04:55:52 GMT"


def _composers(content: CampaignContent) -> tuple[Composer, Composer]:
    made = []
    for skeleton in (content.skeleton, None):
        made_one = composer()
        made_one._date = _OneDate()  # type: ignore[assignment]
        made_one._campaigns[(1, 7)] = replace(content, skeleton=skeleton)
        made_one._senders[1] = (float("inf"), Sender(1, "Acme <news@sender.test>", "news@sender.test", "sender.test"))
        made.append(made_one)
    return made[0], made[1]


def _delivery(email: str, name: Any, city: Any, subscriber_id: int) -> ClaimedDelivery:
    attributes = {"city": city} if city is not None else {}
    job_id = f"campaign:7:{subscriber_id}"
    return ClaimedDelivery(1, 3, job_id, "campaign", 7, subscriber_id, email, {}, 1, 0, False, False, name, attributes)


def _fields(message: OutgoingMessage) -> dict[str, Any]:
    return {name: getattr(message, name) for name in OutgoingMessage.__slots__ if name != "smtp_data"}


def _outcome(made: Composer, delivery: ClaimedDelivery) -> Any:
    try:
        return made.compose(delivery)
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


@given(
    text=st.sampled_from(_TEXTS),
    html=st.sampled_from(_HTMLS),
    subject=st.sampled_from(_SUBJECTS),
    boundary=st.sampled_from(["=_so_0123456789abcdef01234567", "=_so_"]),
    local=st.sampled_from(["ann", "a.b", "x_y", "o'neil", "dots.", "j\u00f6rg"]),
    name=_VALUES,
    city=_VALUES,
    subscriber_id=st.integers(min_value=1, max_value=10**12),
)
@settings(max_examples=400, deadline=None)
# each rule of the skeleton, at least once: a removed rule makes one of these differ
@example(_TEXTS[5], None, "News", "=_so_1", "ann", "", "Paris", 1)  # an empty value before a static dot
@example(_TEXTS[5], None, "News", "=_so_1", "ann", "Ann", "", 1)  # an empty value at the very end
@example(_TEXTS[5], None, "News", "=_so_1", "ann", "Ann", "Paris ", 1)  # whitespace at the very end
@example(_TEXTS[1], None, "News", "=_so_1", "ann", ".Ann", None, 1)  # a value beginning a line with a dot
@example(_TEXTS[1], None, "News", "=_so_1", "ann", "Ann ", None, 1)  # whitespace before a line end
@example(_TEXTS[0], _HTMLS[1], "News", "=_so_", "ann", "x=_so_y", None, 1)  # the boundary in a value
@example(_TEXTS[2], None, "News", "=_so_1", "ann", "Ann", "", 1)  # a tab before a line end
@example(_TEXTS[4], None, "News", "=_so_1", "ann", "a" * 39, None, 1)  # a line grown past 998
def test_a_skeleton_writes_what_the_general_path_writes(
    text: str, html: str | None, subject: str, boundary: str, local: str, name: Any, city: Any, subscriber_id: int
) -> None:
    content = _campaign(text, html, subject, boundary)
    fast, general = _composers(content)
    name = name if isinstance(name, str | None) else str(name)
    delivery = _delivery(f"{local}@example.test", name, city, subscriber_id)
    made, expected = _outcome(fast, delivery), _outcome(general, delivery)
    if not isinstance(expected, OutgoingMessage):
        assert made == expected
        return
    assert isinstance(made, OutgoingMessage)
    assert expected.smtp_data is None
    assert _fields(made) == _fields(expected)
    assert made.smtp_content() == wire_content(expected.as_bytes()) == wire_content(made.as_bytes())


@pytest.mark.parametrize("html", [_HTMLS[1], None])
def test_a_plain_newsletter_goes_through_its_skeleton(html: str | None) -> None:
    # The property above holds as well for a skeleton that always declines: this one must not.
    content = _campaign(_TEXTS[0], html, _SUBJECTS[0], "=_so_0123456789abcdef01234567")
    assert content.skeleton is not None
    fast, _ = _composers(content)
    message = fast.compose(_delivery("ann@example.test", "Ann Smith", "Paris", 42))
    assert message.smtp_data is not None
    assert b"Hello Ann Smith,\r\n" in message.smtp_data and message.smtp_data.endswith(b"\r\n.\r\n")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (_TEXTS[6], "a static part that is not ASCII"),
        (_TEXTS[7], "a template only Jinja can render"),
        ("x" * 990 + "{{ name }}\n", "a line with no room for a value"),
    ],
)
def test_campaigns_a_skeleton_cannot_write_have_none(text: str, why: str) -> None:
    assert _campaign(text, None, "News", "=_so_0123456789abcdef01234567").skeleton is None, why


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("J\u00f6rg", "not ASCII: quoted-printable"),
        ("Ann\nBcc: x", "a line break"),
        ("Ann ", "whitespace before a line end"),
        (".dot", "a dot at the start of a line"),
    ],
)
def test_values_a_skeleton_cannot_take_go_through_the_general_path(name: str, why: str) -> None:
    content = _campaign(_TEXTS[1], None, "News", "=_so_0123456789abcdef01234567")
    assert content.skeleton is not None
    fast, general = _composers(content)
    delivery = _delivery("ann@example.test", name, None, 1)
    made = fast.compose(delivery)
    assert made.smtp_data is None, why
    assert made.smtp_content() == wire_content(general.compose(delivery).as_bytes())


def test_a_skeleton_that_fails_leaves_every_message_to_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # It only ever makes sending cheaper: a skeleton that cannot be made, or that raises for one
    # recipient, must not stop the worker or fail the message.
    from sendonce.delivery.skeleton import Skeleton

    content = _campaign(_TEXTS[0], _HTMLS[1], _SUBJECTS[0], "=_so_0123456789abcdef01234567")
    assert content.skeleton is not None
    fast, general = _composers(content)
    delivery = _delivery("ann@example.test", "Ann", None, 1)

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the shortcut")

    monkeypatch.setattr(Skeleton, "render", fails)
    made = fast.compose(delivery)
    assert made.smtp_data is None and made.smtp_content() == general.compose(delivery).smtp_content()
    monkeypatch.setattr(Skeleton, "of", staticmethod(fails))
    assert _campaign(_TEXTS[0], None, "News", "=_so_1").skeleton is None
