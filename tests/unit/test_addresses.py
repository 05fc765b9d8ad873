from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sendonce.domain.addresses import InvalidAddress, email_key, parse_address


@pytest.mark.parametrize(
    ("given", "key"),
    [
        ("John.Doe@Example.COM", "john.doe@example.com"),
        ("  john.doe@example.com ", "john.doe@example.com"),
        ("user@Bücher.DE", "user@xn--bcher-kva.de"),
        ("user@XN--BCHER-KVA.de", "user@xn--bcher-kva.de"),
        # no provider-specific rewriting: dots and +tags are distinct mailboxes elsewhere
        ("a.b+news@gmail.com", "a.b+news@gmail.com"),
        ("ab@gmail.com", "ab@gmail.com"),
        # a non-ASCII local part is never case-folded (locale-dependent), only NFC-normalized
        ("JOSÉ@example.com", "JOSÉ@example.com"),
        ("José@example.com", "José@example.com"),
        ("İstanbul@example.com", "İstanbul@example.com"),
    ],
)
def test_email_key(given: str, key: str) -> None:
    assert email_key(given) == key


def test_unicode_local_parts_differing_in_case_stay_distinct() -> None:
    assert email_key("JOSÉ@example.com") != email_key("josé@example.com")


def test_nfc_unifies_two_encodings_of_one_character() -> None:
    composed = "jos\u00e9@example.com"
    decomposed = "jose\u0301@example.com"
    assert email_key(composed) == email_key(decomposed)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "   ",
        "plainaddress",
        "@example.com",
        "user@",
        "user@@example.com",
        "us er@example.com",
        "user@example",
        "a" * 65 + "@example.com",
    ],
)
def test_invalid_addresses_are_refused_with_a_reason(bad: str) -> None:
    with pytest.raises(InvalidAddress) as excinfo:
        parse_address(bad)
    assert str(excinfo.value)


def test_smtputf8_and_wire_form() -> None:
    address = parse_address("josé@bücher.de")
    assert address.smtputf8
    assert address.wire == "josé@xn--bcher-kva.de"
    ascii_address = parse_address("Jose@Bücher.de")
    assert not ascii_address.smtputf8
    assert ascii_address.wire == "Jose@xn--bcher-kva.de"


ascii_local = st.text(alphabet=string.ascii_letters + string.digits + "._+-", min_size=1, max_size=20).filter(
    lambda s: not s.startswith(".") and not s.endswith(".") and ".." not in s
)
labels = st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=12)
domains = st.lists(labels, min_size=1, max_size=3).map(lambda parts: ".".join([*parts, "com"]))


def _random_case(text: str, flips: list[bool]) -> str:
    return "".join(c.upper() if f else c.lower() for c, f in zip(text, flips + [False] * len(text), strict=False))


@given(ascii_local, domains, st.lists(st.booleans(), max_size=60))
def test_ascii_addresses_differing_only_in_case_share_one_key(local: str, domain: str, flips: list[bool]) -> None:
    address = f"{local}@{domain}"
    variant = _random_case(address, flips)
    assert email_key(address) == email_key(variant)


@given(ascii_local, ascii_local, domains)
def test_distinct_mailboxes_get_distinct_keys(a: str, b: str, domain: str) -> None:
    if a.lower() == b.lower():
        return
    assert email_key(f"{a}@{domain}") != email_key(f"{b}@{domain}")


@given(ascii_local, domains)
def test_key_is_idempotent(local: str, domain: str) -> None:
    key = email_key(f"{local}@{domain}")
    assert email_key(key) == key
