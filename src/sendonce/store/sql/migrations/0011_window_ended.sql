-- 0011: a signup window ends when its mail certainly reached nobody, or when a later window of the
-- same signup replaced it.
--
-- Since 0010 a signup's windows are found by the signup, whatever secret keyed them, and the latest
-- decides. An older window under another secret (A, then B after a rotation, then A again on a host
-- not yet redeployed or after a rollback) was still judged on its own: once a prune had taken its
-- dead mail, it read as open, and a repeat was told "queued" while nothing was. A window with a later
-- one is over, whatever its age says.
--
-- STABLE, as window_mail_dead: it reads in the snapshot of the statement that calls it.
CREATE FUNCTION sendonce.window_ended(
    p_account bigint, p_signup bigint, p_window bigint, p_generation integer, p_opened_at timestamptz
)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN sendonce.window_mail_dead(p_account, p_window, p_generation)
        OR EXISTS (SELECT 1 FROM sendonce.signup_windows later
                    WHERE later.account_id = p_account AND later.signup_id = p_signup
                      AND later.opened_at > p_opened_at);
END
$$;
