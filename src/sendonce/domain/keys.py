"""Keys derived under the server secret: operation keys and signed, expiring links.

Operation keys identify an idempotent operation (one signup verification per address, origin and
window) without being derivable by anyone who lacks the secret, so a client can neither predict a
key nor use one to suppress someone else's mail. Links (verification, unsubscribe) are signed, so a
forged one is rejected without a database lookup; ``itsdangerous`` does the signing, with key
rotation: the previous secret still verifies what was signed before the rotation.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from cryptography.fernet import Fernet, MultiFernet
from cryptography.fernet import InvalidToken as InvalidFernetToken
from itsdangerous import BadSignature, SignatureExpired, Signer, URLSafeSerializer, URLSafeTimedSerializer

SIGNUP_EVENT = "signup_verification_requested"


def operation_key(secret: bytes, account_id: int, event: str, email_key: str, origin: str) -> str:
    """HMAC-SHA256 of the operation's identity. The fields are joined with a separator that cannot
    occur in any of them (unit separator), so two different tuples never produce the same message."""
    message = "\x1f".join((str(account_id), event, email_key, origin)).encode("utf-8")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class InvalidToken(ValueError):
    """The link is forged, damaged, or for another purpose."""


class ExpiredToken(InvalidToken):
    """The link was genuine but has expired."""


_PROBE = {"probe": [1, "x"], "n": 2**40}
"""A payload that zlib cannot shorten: itsdangerous's token for it is what the fast path must make."""

_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""itsdangerous's JSON (compact, UTF-8), made once rather than per token."""


class _StableSigner:
    """Signs as ``URLSafeSerializer.dumps`` does, at a fraction of its cost per token.

    itsdangerous tries zlib on every payload (a deflate state of a quarter of a megabyte set up and
    freed per call), derives the signing key again for every token and computes its HMAC through the
    pure-Python path of ``hmac``. Here the payload is never compressed, the key is derived once and
    the HMAC is one OpenSSL call. itsdangerous's ``loads`` reads compressed and uncompressed payloads
    alike, so every token verifies; and where zlib would not shorten a payload (ids as they come: none
    of 100,000 random ones below 10**9; a long run of one digit, 1111111, can) the token is byte for byte
    itsdangerous's own. Used only when a probe token agrees with itsdangerous's; otherwise (another
    version signs differently) itsdangerous signs.
    """

    def __init__(self, serializer: URLSafeSerializer) -> None:
        self._serializer = serializer
        self._signer: Signer = serializer.make_signer(serializer.salt)
        self._key = self._signer.derive_key()
        self._sep = self._signer.sep
        self._fast = self._dumps_fast(_PROBE) == serializer.dumps(_PROBE)

    def _dumps_fast(self, payload: Any) -> str:
        value = base64.urlsafe_b64encode(_COMPACT_JSON.encode(payload).encode("utf-8")).rstrip(b"=")
        mac = hmac.digest(self._key, value, "sha1")
        return (value + self._sep + base64.urlsafe_b64encode(mac).rstrip(b"=")).decode("ascii")

    def dumps(self, payload: Any) -> str:
        return self._dumps_fast(payload) if self._fast else str(self._serializer.dumps(payload))


@dataclass(frozen=True)
class KeyRing:
    """The current secret and, during a rotation, the previous one; and retired secrets, which only
    verify the never-expiring unsubscribe links of mail sent under them (they sign nothing, and no
    operation key, sealed answer or expiring link is read with them)."""

    current: bytes
    previous: bytes | None = None
    retired: tuple[bytes, ...] = ()
    _stable_signers: dict[str, _StableSigner] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per purpose, made once: a campaign signs one unsubscribe link per recipient."""

    def __post_init__(self) -> None:
        if len(self.current) < 16:
            raise ValueError("the server secret must be at least 16 bytes long")
        if any(len(secret) < 16 for secret in self.retired):
            raise ValueError("a retired secret must be at least 16 bytes long (SENDONCE_SECRET_RETIRED)")

    def operation_key(self, account_id: int, event: str, email_key: str, origin: str) -> str:
        """The operation's key under the current secret. (A signup's windows opened under another
        secret are found through the signup, migration 0010: no key under the previous one is needed.)"""
        return operation_key(self.current, account_id, event, email_key, origin)

    def _fernet(self) -> MultiFernet:
        def key(secret: bytes) -> Fernet:
            return Fernet(base64.urlsafe_b64encode(hmac.new(secret, b"sendonce.seal", hashlib.sha256).digest()))

        return MultiFernet([key(self.current)] + ([key(self.previous)] if self.previous else []))

    def seal(self, data: bytes) -> str:
        """Encrypt and authenticate ``data`` under the server secret (for secrets kept for a while)."""
        return self._fernet().encrypt(data).decode("ascii")

    def unseal(self, token: str) -> bytes:
        try:
            return self._fernet().decrypt(token.encode("ascii"))
        except (InvalidFernetToken, ValueError):
            raise InvalidToken("cannot be opened with the current or previous secret") from None

    def _serializer(self, purpose: str) -> URLSafeTimedSerializer:
        # itsdangerous signs with the last key and accepts any of them.
        keys = [self.previous, self.current] if self.previous else [self.current]
        return URLSafeTimedSerializer(keys, salt=f"sendonce.{purpose}")

    def _stable(self, purpose: str) -> URLSafeSerializer:
        keys = [self.previous, self.current] if self.previous else [self.current]
        return URLSafeSerializer(keys, salt=f"sendonce.{purpose}")

    def sign_stable(self, purpose: str, payload: dict[str, Any]) -> str:
        """A signed token without a timestamp: the same payload always gives the same token (so a
        re-sent message is identical), and it never expires (unsubscribe links must keep working).
        One exception, across versions: before tokens stopped being compressed, a payload zlib could
        shorten (an id that is a long run of one digit) got another token; a message re-sent by the
        newer version carries the new one. Both verify."""
        signer = self._stable_signers.get(purpose)
        if signer is None:
            signer = self._stable_signers[purpose] = _StableSigner(self._stable(purpose))
        return signer.dumps(payload)

    def verify_stable(self, purpose: str, token: str) -> dict[str, Any]:
        keys = [*self.retired, *([self.previous] if self.previous else []), self.current]
        try:
            payload = URLSafeSerializer(keys, salt=f"sendonce.{purpose}").loads(token)
        except BadSignature:
            raise InvalidToken("the link is not valid") from None
        if not isinstance(payload, dict):
            raise InvalidToken("the link is not valid")
        return payload

    def sign(self, purpose: str, payload: dict[str, Any]) -> str:
        return str(self._serializer(purpose).dumps(payload))

    def verify(self, purpose: str, token: str, *, max_age: float | None = None) -> dict[str, Any]:
        try:
            payload = self._serializer(purpose).loads(token, max_age=None if max_age is None else int(max_age))
        except SignatureExpired:
            raise ExpiredToken("the link has expired") from None
        except BadSignature:
            raise InvalidToken("the link is not valid") from None
        if not isinstance(payload, dict):
            raise InvalidToken("the link is not valid")
        return payload
