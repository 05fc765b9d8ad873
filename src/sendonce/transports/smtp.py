"""SMTP through persistent aiosmtplib connections, one per channel.

Plain SMTP has no idempotency key: if the connection drops after the message data went out and
before the server's final answer, nobody knows whether it was accepted. Such a failure is returned
as an *uncertain* retry, and the re-send is written to the possible-duplicate ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import aiosmtplib

from sendonce.domain.message import OutgoingMessage
from sendonce.transports.base import (
    Accepted,
    Capabilities,
    Channel,
    Gate,
    Outcome,
    Permanent,
    Retry,
    Transport,
    Withheld,
)

logger = logging.getLogger(__name__)

# A connection idle longer than this is probed with RSET before it is trusted with a message.
_IDLE_PROBE_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class SmtpSettings:
    host: str
    port: int
    use_tls: bool = False
    start_tls: bool | None = False
    username: str | None = None
    password: str | None = None
    timeout: float = 30.0
    validate_certs: bool = True
    local_hostname: str | None = None


class SmtpTransport(Transport):
    capabilities = Capabilities(name="smtp", idempotent=False)

    def __init__(self, settings: SmtpSettings) -> None:
        self.settings = settings
        self.rate_bucket = f"transport:smtp:{settings.host}:{settings.port}"

    def channel(self) -> SmtpChannel:
        return SmtpChannel(self.settings)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


class SmtpChannel(Channel):
    def __init__(self, settings: SmtpSettings) -> None:
        self.settings = settings
        self.rate_bucket = f"transport:smtp:{settings.host}:{settings.port}"
        self._smtp: aiosmtplib.SMTP | None = None
        self._dirty = False
        self._last_used = 0.0

    async def _connection(self, timeout: float) -> aiosmtplib.SMTP:
        if self._smtp is not None and self._smtp.is_connected:
            if not self._dirty and time.monotonic() - self._last_used <= _IDLE_PROBE_SECONDS:
                return self._smtp
            # After a failed transaction, and before reusing an idle connection: reset the envelope,
            # and find out now (not mid-message) whether the server is still there.
            try:
                await self._smtp.rset(timeout=timeout)
            except (TimeoutError, aiosmtplib.SMTPException, OSError):
                logger.debug("RSET failed; reconnecting")
            else:
                self._dirty = False
                return self._smtp
        await self.close()
        s = self.settings
        smtp = aiosmtplib.SMTP(
            hostname=s.host,
            port=s.port,
            use_tls=s.use_tls,
            start_tls=s.start_tls,
            username=s.username,
            password=s.password,
            timeout=timeout,
            validate_certs=s.validate_certs,
            local_hostname=s.local_hostname,
        )
        await smtp.connect(timeout=timeout)
        if smtp.is_ehlo_or_helo_needed:
            # Extensions (SMTPUTF8, 8BITMIME) are known only after EHLO.
            await smtp.ehlo(timeout=timeout)
        self._smtp = smtp
        self._dirty = False
        return smtp

    async def send(self, message: OutgoingMessage, *, timeout: float, gate: Gate | None = None) -> Outcome:
        timeout = min(timeout, self.settings.timeout)  # the URL's ?timeout= caps every step
        phase = "connect"
        try:
            smtp = await self._connection(timeout)
            options: list[str] = []
            encoding = "ascii"
            if message.smtputf8:
                if not smtp.supports_extension("smtputf8"):
                    return Permanent(
                        f"{message.recipient!r} has a non-ASCII local part and the server does not offer "
                        "SMTPUTF8 (RFC 6531)"
                    )
                options.append("SMTPUTF8")
                encoding = "utf-8"
            data = message.as_bytes()
            if not message.smtputf8 and smtp.supports_extension("8bitmime") and not data.isascii():
                options.append("BODY=8BITMIME")
            phase = "mail"
            await smtp.mail(message.envelope_from, options=options, encoding=encoding, timeout=timeout)
            phase = "rcpt"
            await smtp.rcpt(message.recipient, encoding=encoding, timeout=timeout)
            if gate is not None:
                # The envelope is on the server; nothing is delivered until DATA. The caller may hold
                # the message here (its previous one is being recorded) or withdraw it.
                left = await gate()
                if left is None:
                    self._dirty = True  # RSET before the next message
                    return Withheld("withheld before DATA")
                timeout = max(min(timeout, left, self.settings.timeout), 0.1)
            phase = "data"
            response = await smtp.data(data, timeout=timeout)
        except aiosmtplib.SMTPResponseException as exc:
            self._dirty = True
            if exc.code == 421:  # the server is closing the connection
                await self.close()
            if 500 <= exc.code < 600:
                # A 5xx to RCPT or DATA rejects this recipient for good: a hard bounce.
                return Permanent(f"{phase}: {exc.code} {exc.message}"[:500], hard_bounce=phase in ("rcpt", "data"))
            return Retry(f"{phase}: {exc.code} {exc.message}"[:500])
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as exc:
            await self.close()
            # Past the start of DATA the server may have accepted the message before we lost it.
            return Retry(f"{phase}: {_describe(exc)}", uncertain=phase == "data")
        except UnicodeEncodeError as exc:
            # an address that needs SMTPUTF8 where the envelope cannot carry it
            self._dirty = True
            return Permanent(f"{phase}: an address cannot be written in ASCII: {exc}"[:500])
        except Exception as exc:  # anything else must not take the worker down with it
            logger.exception("unexpected error sending %s", message.job_id)
            await self.close()
            return Retry(f"{phase}: unexpected {_describe(exc)}", uncertain=phase == "data")
        self._last_used = time.monotonic()
        return Accepted(f"{response.code} {response.message}"[:300])

    async def close(self) -> None:
        smtp, self._smtp = self._smtp, None
        if smtp is None:
            return
        try:
            if smtp.is_connected:
                smtp.close()
        except Exception:  # closing a broken connection may fail; nothing is lost
            logger.debug("closing SMTP connection failed", exc_info=True)
