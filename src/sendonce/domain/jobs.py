"""Deterministic job ids: the durable identity of one intended message.

A job id is derived from what the message *is* (campaign and subscriber, or the transactional
operation), never from a uuid or a clock, so every retry of the same intent carries the same id.
It travels to the transport as the idempotency key, in the ``Sendonce-Job-Id`` header, and as the
``Message-ID``.
"""

from __future__ import annotations

import re

JOB_ID_HEADER = "Sendonce-Job-Id"


_JOB_ID = re.compile(r"^[a-z][a-z0-9_]*(:[A-Za-z0-9_\-]+)+$")


def campaign_job_id(campaign_id: int, subscriber_id: int) -> str:
    return f"campaign:{campaign_id}:{subscriber_id}"


def transactional_job_id(kind: str, operation_id: str) -> str:
    """Job id of a transactional message; ``operation_id`` must already be deterministic."""
    job_id = f"{kind}:{operation_id}"
    if not _JOB_ID.match(job_id):
        raise ValueError(f"not a valid job id: {job_id!r}")
    return job_id


def message_id(job_id: str, domain: str) -> str:
    """A deterministic RFC 5322 Message-ID for a job.

    The left part must be a dot-atom, which has no ``:``; job ids are ``[a-z0-9_-]`` segments joined
    by ``:``, so mapping ``:`` to ``.`` is reversible and never produces two adjacent dots.
    """
    if not _JOB_ID.match(job_id):
        raise ValueError(f"not a valid job id: {job_id!r}")
    return f"<{job_id.replace(':', '.')}@{domain}>"
