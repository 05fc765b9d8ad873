-- 0009: one definition of "the mail of a signup window certainly reached nobody".
--
-- A signup window is open while it has not run out and its mail is not certainly dead: that mail
-- (job id signup:<window>:<generation>) ended failed or suppressed, and no attempt of it may have
-- been taken by the transport (not uncertain). Three statements ask it: the lock-free read that
-- answers repeats (peek_repeat), the locking way's read (lock_window) and the reopening of a window
-- (open_window). Each spelled the condition out; a change to one that missed the others would let a
-- repeat and the locking way disagree on whether the window is open.
--
-- STABLE: it reads in the snapshot of the statement that calls it, as the condition did inline.
-- PL/pgSQL, so its query's plan is kept by the session rather than made again at every call.
CREATE FUNCTION sendonce.window_mail_dead(p_account bigint, p_window bigint, p_generation integer)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM sendonce.deliveries d
                    WHERE d.account_id = p_account
                      AND d.job_id = 'signup:' || p_window || ':' || p_generation
                      AND d.status IN ('failed', 'suppressed') AND NOT d.uncertain);
END
$$;
