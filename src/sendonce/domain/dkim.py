"""DKIM signing (RFC 6376) with dkimpy.

The signature covers the headers that identify and route the message and, as RFC 8058 requires for
one-click unsubscribe, ``List-Unsubscribe`` and ``List-Unsubscribe-Post``. Canonicalization is
relaxed/relaxed, which survives the header refolding and whitespace changes relays make.
"""

from __future__ import annotations

from dataclasses import dataclass

import dkim

SIGNED_HEADERS = (
    b"from",
    b"to",
    b"subject",
    b"date",
    b"message-id",
    b"mime-version",
    b"content-type",
    b"list-unsubscribe",
    b"list-unsubscribe-post",
    b"feedback-id",
    b"sendonce-job-id",
)


@dataclass(frozen=True, slots=True)
class DkimKey:
    domain: str
    selector: str
    private_key: bytes
    """PEM (RSA or Ed25519)."""

    def __repr__(self) -> str:  # never print the key
        return f"DkimKey(domain={self.domain!r}, selector={self.selector!r})"

    def sign(self, message: bytes) -> bytes:
        """The ``DKIM-Signature:`` header line (CRLF-terminated) to put in front of ``message``."""
        present = {
            line.split(b":", 1)[0].strip().lower()
            for line in message.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if line and line[:1] not in (b" ", b"\t")
        }
        signature: bytes = dkim.sign(
            message,
            self.selector.encode(),
            self.domain.encode(),
            self.private_key,
            canonicalize=(b"relaxed", b"relaxed"),
            include_headers=[h for h in SIGNED_HEADERS if h in present],
        )
        return signature
