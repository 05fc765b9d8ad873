-- 0007: when a row became uncertain, so that a re-send past an idempotency key's life is ledgered.
--
-- An idempotent transport (Resend) drops a second request with the same key, but only while it
-- remembers the key (24 hours). A row whose attempt may have reached the provider and that is re-sent
-- after that (an uncertain attempt, then a campaign paused overnight, a long outage) can be delivered
-- twice. Until now such a re-send wrote nothing to the possible_duplicates ledger, which was written
-- only for transports without keys: a silent duplicate. uncertain_since is the moment the row last
-- became uncertain after a send succeeded (NULL while it is not uncertain); the claim writes the
-- ledger for an idempotent transport too when that moment is older than the key's life, with a margin.
ALTER TABLE sendonce.deliveries ADD COLUMN uncertain_since timestamptz;
-- Rows uncertain today: their last change is the best guess of when their doubt began.
UPDATE sendonce.deliveries SET uncertain_since = updated_at WHERE uncertain;
