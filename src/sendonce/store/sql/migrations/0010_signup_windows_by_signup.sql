-- 0010: a signup's windows found by the signup, whatever secret keyed them.
--
-- A window is keyed by its operation key, an HMAC of the address under the server secret. After a
-- rotation, a window opened under the old secret was found only while SENDONCE_SECRET_PREVIOUS named
-- it: drop that setting within the window (or run a process with another secret) and a repeat opened
-- a second window, and sent a second mail. The locking way now also reads the signup's latest window
-- through this index, under any key.
CREATE INDEX signup_windows_by_signup ON sendonce.signup_windows (account_id, signup_id, opened_at);
