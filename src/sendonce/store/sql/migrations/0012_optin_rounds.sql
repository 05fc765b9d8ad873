-- 0012: a double opt-in confirmation that can no longer confirm anyone is sent again.
--
-- A pending membership got one confirmation mail, ever: its job id (optin:<list>:<subscriber>) named
-- the membership, so adding the subscriber again queued nothing. When that mail certainly reached
-- nobody (it failed after its retries: a relay down for a while) or its link expired (SENDONCE_OPTIN_TTL),
-- the membership stayed pending for good, and only "preconfirm", which skips consent, could get it out.
-- A membership now counts its confirmation rounds: adding the subscriber again while the last round's
-- mail is dead or expired moves it to the next round (a compare-and-set on the round), whose mail has
-- a job id of its own. One mail per round, however many requests race; none while a mail is on its way
-- or its link still works.
ALTER TABLE sendonce.list_members ADD COLUMN optin_round integer NOT NULL DEFAULT 0;

-- The job id of a membership's confirmation mail in a round (round 0 keeps the id it always had).
CREATE FUNCTION sendonce.optin_job_id(p_list bigint, p_subscriber bigint, p_round integer)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT 'optin:' || p_list || ':' || p_subscriber || CASE WHEN p_round = 0 THEN '' ELSE ':' || p_round END
$$;
