"""Email address validation and the ``email_key`` used for deduplication and suppression.

The key is deliberately conservative: two addresses share a key only when every mail system would
deliver them to the same mailbox.

* the domain is lower-cased and IDNA-encoded (A-labels), so ``Bücher.DE`` and ``xn--bcher-kva.de``
  are one domain;
* an ASCII local part is lower-cased: almost every mailbox provider treats it case-insensitively;
* a local part with non-ASCII characters is kept exactly as given (after Unicode NFC, which only
  unifies different encodings of the same characters): Unicode case folding is locale-dependent
  (Turkish dotless i, German sharp s), and RFC 6531 leaves the local part to the receiving server;
* no provider-specific rewriting (Gmail dots and ``+tags``): that would merge addresses that other
  providers treat as different people.
"""

from __future__ import annotations

from dataclasses import dataclass

from email_validator import EmailNotValidError, validate_email


class InvalidAddress(ValueError):
    """The text is not a usable email address; the message says why."""


@dataclass(frozen=True, slots=True)
class Address:
    """A validated address: what the person typed, what we send to, and the dedup key."""

    given: str
    """The address as given, trimmed."""
    normalized: str
    """Local part as given (NFC), domain in Unicode lower case: what we show and send to."""
    ascii_domain: str
    """The domain in A-labels, used on the wire."""
    local_part: str
    key: str
    """``email_key``: see the module docstring."""

    @property
    def smtputf8(self) -> bool:
        """True when the local part needs SMTPUTF8 (RFC 6531) to be sent at all."""
        return not self.local_part.isascii()

    @property
    def wire(self) -> str:
        """The address as it goes on the SMTP envelope and in headers: A-label domain."""
        return f"{self.local_part}@{self.ascii_domain}"


def parse_address(text: str) -> Address:
    """Validate ``text`` and derive its key. Raises :class:`InvalidAddress` with a readable reason."""
    if not isinstance(text, str):
        raise InvalidAddress("an email address must be a string")
    given = text.strip()
    if not given:
        raise InvalidAddress("the email address is empty")
    try:
        valid = validate_email(
            given,
            check_deliverability=False,
            allow_smtputf8=True,
            # RFC 5321 limits too (64 octets before the @): a server would refuse them anyway.
            strict=True,
            # ``.test`` is reserved for testing (RFC 2606) and is what our users' test suites use.
            test_environment=True,
        )
    except EmailNotValidError as exc:
        raise InvalidAddress(f"{given!r} is not a valid email address: {exc}") from None
    local = valid.local_part
    ascii_domain = (valid.ascii_domain or valid.domain).lower()
    key_local = local.lower() if local.isascii() else local
    return Address(
        given=given,
        normalized=f"{local}@{valid.domain.lower()}",
        ascii_domain=ascii_domain,
        local_part=local,
        key=f"{key_local}@{ascii_domain}",
    )


def email_key(text: str) -> str:
    return parse_address(text).key
