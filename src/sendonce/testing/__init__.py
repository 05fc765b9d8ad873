"""Real servers to test against: an SMTP inbox (aiosmtpd) and a Resend-compatible HTTP API.

They are part of the package because the demo and ``sendonce chaos`` use them as well as the tests.
Both bind to loopback only.
"""
