-- 0008: a transient failure is counted once per attempt, even when its record is written twice.
--
-- A worker records a group of outcomes in one transaction. When the commit succeeds but its answer
-- never arrives (the connection breaks at that instant), the worker cannot tell and records the
-- group again. record_retry accepts a row that is 'queued' at the same attempt (its lease ran out
-- and nobody re-claimed it: that attempt's failure is not counted yet), so the second record of the
-- same retry counted the same failure twice, and the row could give up one attempt early.
-- failure_attempt is the attempt whose failure 'failures' last counted (NULL: none yet).
ALTER TABLE sendonce.deliveries ADD COLUMN failure_attempt integer;

-- And a give-up after an ambiguous attempt (the connection dropped after the content) is now marked
-- uncertain: possibly delivered. Rows that gave up before this migration did not record whether their
-- last attempt was ambiguous; they are marked uncertain too, since some were, and a signup repeat
-- re-queues a failed mail only if it is certain that none of its attempts reached anyone.
UPDATE sendonce.deliveries
   SET uncertain = true, uncertain_since = coalesce(uncertain_since, updated_at)
 WHERE status = 'failed' AND NOT uncertain AND last_error LIKE 'gave up after %';
