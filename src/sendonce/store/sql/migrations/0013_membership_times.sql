-- 0013: when a membership was unsubscribed, and when its current confirmation round began; the
-- table of the secret that processes on one database share (made here, by the role that migrates,
-- as well as on demand by the first process that needs it).
--
-- A resubscribe from the unsubscribe page's link undid an unsubscribe "of the last day", judged by
-- updated_at, which other writes touch too (a signup's verification confirming its list leaves an
-- unsubscribed membership as it is, and stamped updated_at). unsubscribed_at is set by the
-- unsubscribe alone. round_started_at dates a double opt-in round, so that a round whose mail was
-- pruned away is judged by its own age, not the membership's.
ALTER TABLE sendonce.list_members
    ADD COLUMN unsubscribed_at timestamptz,
    ADD COLUMN round_started_at timestamptz;

UPDATE sendonce.list_members SET unsubscribed_at = updated_at WHERE status = 'unsubscribed';

CREATE TABLE IF NOT EXISTS sendonce_meta.generated_secret (
    only_one   boolean PRIMARY KEY DEFAULT true CHECK (only_one),
    secret     text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
