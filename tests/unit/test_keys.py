from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sendonce.domain.addresses import email_key
from sendonce.domain.keys import SIGNUP_EVENT, ExpiredToken, InvalidToken, KeyRing, operation_key

SECRET = b"a-secret-of-sufficient-length!!"
local = st.text(alphabet=string.ascii_letters + string.digits + "._+-", min_size=1, max_size=16).filter(
    lambda s: not s.startswith(".") and not s.endswith(".") and ".." not in s
)
domain = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=10).map(lambda s: f"{s}.test")
origins = st.sampled_from(["web", "app", "api"])
accounts = st.integers(min_value=1, max_value=2**63 - 1)


@given(accounts, local, domain, origins, st.lists(st.booleans(), max_size=40))
def test_equivalent_inputs_give_one_key(account: int, lp: str, dom: str, origin: str, flips: list[bool]) -> None:
    address = f"{lp}@{dom}"
    variant = "".join(c.upper() if f else c for c, f in zip(address, flips + [False] * len(address), strict=False))
    assert operation_key(SECRET, account, SIGNUP_EVENT, email_key(address), origin) == operation_key(
        SECRET, account, SIGNUP_EVENT, email_key(f"  {variant} "), origin
    )


@given(st.tuples(accounts, local, domain, origins), st.tuples(accounts, local, domain, origins))
def test_distinct_operations_never_collide(a: tuple[int, str, str, str], b: tuple[int, str, str, str]) -> None:
    key_a = (a[0], email_key(f"{a[1]}@{a[2]}"), a[3])
    key_b = (b[0], email_key(f"{b[1]}@{b[2]}"), b[3])
    if key_a == key_b:
        return
    assert operation_key(SECRET, key_a[0], SIGNUP_EVENT, key_a[1], key_a[2]) != operation_key(
        SECRET, key_b[0], SIGNUP_EVENT, key_b[1], key_b[2]
    )


@given(st.binary(min_size=16, max_size=64), st.binary(min_size=16, max_size=64), accounts, local, domain, origins)
def test_the_secret_matters(s1: bytes, s2: bytes, account: int, lp: str, dom: str, origin: str) -> None:
    if s1 == s2:
        return
    ek = email_key(f"{lp}@{dom}")
    assert operation_key(s1, account, SIGNUP_EVENT, ek, origin) != operation_key(s2, account, SIGNUP_EVENT, ek, origin)


def test_fields_cannot_be_shifted_into_each_other() -> None:
    # without a separator, ("1", "2x") and ("12", "x") would hash the same message
    assert operation_key(SECRET, 1, "2x", "a@b.test", "web") != operation_key(SECRET, 12, "x", "a@b.test", "web")


def test_tokens_verify_reject_forgeries_and_survive_rotation() -> None:
    old = KeyRing(SECRET)
    token = old.sign("verify", {"a": 1, "s": 2})
    assert old.verify("verify", token) == {"a": 1, "s": 2}
    with pytest.raises(InvalidToken):
        old.verify("unsubscribe", token)  # a token for one purpose is not valid for another
    with pytest.raises(InvalidToken):
        old.verify("verify", token[:-2] + "xx")
    rotated = KeyRing(b"the-next-secret-of-enough-bytes", previous=SECRET)
    assert rotated.verify("verify", token) == {"a": 1, "s": 2}
    # an operation key is the current secret's: rotating it changes the key (windows are found by signup)
    assert rotated.operation_key(1, SIGNUP_EVENT, "a@b.test", "web") != old.operation_key(
        1, SIGNUP_EVENT, "a@b.test", "web"
    )
    with pytest.raises(InvalidToken):
        KeyRing(b"the-next-secret-of-enough-bytes").verify("verify", token)
    with pytest.raises(ExpiredToken):
        old.verify("verify", old.sign("verify", {"a": 1}), max_age=-1)
    with pytest.raises(ValueError, match="16 bytes"):
        KeyRing(b"short")


@given(
    st.dictionaries(st.sampled_from("ascb"), st.integers(min_value=0, max_value=2**62), min_size=1),
    st.booleans(),
)
def test_stable_tokens_verify_with_itsdangerous_and_match_its_own_where_it_does_not_compress(
    payload: dict[str, int], rotated: bool
) -> None:
    # Links already in mailboxes must keep verifying, and a re-sent message must carry the same link:
    # the signer cached per purpose signs as itsdangerous does, except that it never compresses.
    from itsdangerous import URLSafeSerializer

    ring = KeyRing(b"current-secret-0123456789", b"previous-secret-0123456789" if rotated else None)
    keys = [ring.previous, ring.current] if ring.previous else [ring.current]
    usual = URLSafeSerializer(keys, salt="sendonce.unsubscribe")
    token = ring.sign_stable("unsubscribe", payload)
    assert ring.sign_stable("unsubscribe", payload) == token  # the cached signer, a second time
    assert usual.loads(token) == payload
    assert ring.verify_stable("unsubscribe", token) == payload
    if not usual.dump_payload(payload).startswith(b"."):  # itsdangerous did not compress it
        assert token == usual.dumps(payload)
    assert ring.verify_stable("unsubscribe", usual.dumps(payload)) == payload  # its compressed ones too
    with pytest.raises(InvalidToken):
        ring.verify_stable("other-purpose", token)


def test_stable_tokens_of_compressible_payloads_are_not_compressed() -> None:
    from itsdangerous import URLSafeSerializer

    ring = KeyRing(b"current-secret-0123456789")
    payload = {"a": 1, "s": 1111111111111111111, "c": 1111111111111111111}
    usual = URLSafeSerializer([ring.current], salt="sendonce.unsubscribe")
    assert usual.dumps(payload).startswith(".")  # itsdangerous compresses this one
    token = ring.sign_stable("unsubscribe", payload)
    assert not token.startswith(".")
    assert usual.loads(token) == payload == ring.verify_stable("unsubscribe", token)


def test_stable_signer_takes_the_fast_path_only_when_it_agrees_with_itsdangerous() -> None:
    import hashlib

    from itsdangerous import URLSafeSerializer

    from sendonce.domain.keys import _StableSigner

    payload = {"a": 7, "s": 1_234_567_890_123, "c": 3}  # zlib cannot shorten it: itsdangerous does not compress
    usual = URLSafeSerializer([b"current-secret-0123456789"], salt="sendonce.unsubscribe")
    fast = _StableSigner(usual)
    assert fast._fast  # itsdangerous's defaults (HMAC-SHA1, django-concat): one OpenSSL call per token
    assert fast.dumps(payload) == usual.dumps(payload)
    # A serializer that signs some other way: the probe disagrees and itsdangerous signs every token.
    other = URLSafeSerializer(
        [b"current-secret-0123456789"], salt="sendonce.unsubscribe", signer_kwargs={"digest_method": hashlib.sha256}
    )
    careful = _StableSigner(other)
    assert not careful._fast
    assert careful.dumps(payload) == other.dumps(payload)


def test_retired_secrets_verify_unsubscribe_links_and_nothing_else() -> None:
    # An unsubscribe link never expires, so mail signed two rotations ago must still unsubscribe;
    # a retired secret signs nothing and opens no other kind of token.
    old = KeyRing(b"oldest-secret-0123456789")
    token = old.sign_stable("unsubscribe", {"a": 1, "s": 2, "c": 3})
    timed = old.sign("verify", {"a": 1})
    rotated_twice = KeyRing(b"current-secret-0123456789", b"previous-secret-0123456789")
    with pytest.raises(InvalidToken):
        rotated_twice.verify_stable("unsubscribe", token)
    kept = KeyRing(b"current-secret-0123456789", b"previous-secret-0123456789", (b"oldest-secret-0123456789",))
    assert kept.verify_stable("unsubscribe", token) == {"a": 1, "s": 2, "c": 3}
    assert kept.sign_stable("unsubscribe", {"a": 1, "s": 2, "c": 3}) == rotated_twice.sign_stable(
        "unsubscribe", {"a": 1, "s": 2, "c": 3}
    )  # signed with the current secret, as before
    with pytest.raises(InvalidToken):
        kept.verify("verify", timed)
    with pytest.raises(ValueError, match="retired"):
        KeyRing(b"current-secret-0123456789", None, (b"short",))
