-- 0008: a transient failure is counted once per attempt, even when its record is written twice.
--
-- A worker records a group of outcomes in one transaction. When the commit succeeds but its answer
-- never arrives (the connection breaks at that instant), the worker cannot tell and records the
-- group again. record_retry accepts a row that is 'queued' at the same attempt (its lease ran out
-- and nobody re-claimed it: that attempt's failure is not counted yet), so the second record of the
-- same retry counted the same failure twice, and the row could give up one attempt early.
-- failure_attempt is the attempt whose failure 'failures' last counted (NULL: none yet).
ALTER TABLE sendonce.deliveries ADD COLUMN failure_attempt integer;
