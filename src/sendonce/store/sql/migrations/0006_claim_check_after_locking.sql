-- 0006: the claim's checks see every opt-out and pause that committed before the claim locked the row.
--
-- The claim is one statement, and in READ COMMITTED a statement reads in the snapshot taken when it
-- started; but it locks its rows later, one by one, as it walks the queue. An opt-out that commits in
-- between (after the snapshot, before the claim reaches the row) was invisible to a check made
-- inside the statement, and the row was claimed for sending although the opt-out had landed before
-- it was claimed. (Seen once in about 30 runs of `sendonce chaos --scenario races`.)
--
-- A pause or a cancel likewise: the claim picks rows of campaigns that are 'sending' in its
-- snapshot, so a pause that committed before the claim reached a row did not keep it from being
-- claimed and sent.
--
-- This function makes both checks. It is VOLATILE, so its query does not run in the caller's
-- snapshot: it reads in a snapshot of its own, taken when it runs. The claim calls it once, with
-- every row it has locked, after it has locked them all. "blocked": the recipient opted out or left
-- (the row ends 'suppressed'); "claimable" false: the row's campaign is no longer sending (the row
-- stays queued, untouched).
--
-- Only in READ COMMITTED: in REPEATABLE READ or SERIALIZABLE every query of a transaction reads its
-- first snapshot, and the checks would be as blind as before. A role's or a database's
-- default_transaction_isolation could bring that about silently, so the function refuses to run.
--
-- PL/pgSQL rather than SQL: a SQL function's query is planned again at every call (0.4 ms more per
-- claim); PL/pgSQL keeps its plan. ROWS 20 (a batch): with the default estimate of 1,000 rows, the
-- claim's UPDATE read the whole outbox (a hash join) to join the answer.
CREATE FUNCTION sendonce.claim_check(account_ids bigint[], delivery_ids bigint[])
RETURNS TABLE (account_id bigint, delivery_id bigint, name text, attributes jsonb, blocked boolean,
               claimable boolean)
LANGUAGE plpgsql VOLATILE ROWS 20
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'sendonce claims must run in READ COMMITTED, not %', current_setting('transaction_isolation')
              USING HINT = 'the opt-out and pause checks need a snapshot taken after the claim''s row locks: '
                           'set default_transaction_isolation to ''read committed'' for the worker''s role';
    END IF;
    RETURN QUERY
    SELECT d.account_id, d.delivery_id, s.name, s.attributes,
           (EXISTS (SELECT 1 FROM sendonce.suppressions x
                     WHERE x.account_id = d.account_id AND x.email_key = d.email_key)
            OR (d.campaign_id IS NOT NULL AND NOT (
                    s.status IS NOT DISTINCT FROM 'confirmed'
                    AND EXISTS (SELECT 1
                                  FROM sendonce.list_members m
                                  JOIN sendonce.campaign_lists cl
                                    ON cl.account_id = m.account_id AND cl.list_id = m.list_id
                                 WHERE m.account_id = d.account_id AND m.subscriber_id = d.subscriber_id
                                   AND m.status = 'confirmed' AND cl.campaign_id = d.campaign_id)))),
           (d.campaign_id IS NULL OR EXISTS (SELECT 1 FROM sendonce.campaigns c
                                              WHERE c.account_id = d.account_id AND c.campaign_id = d.campaign_id
                                                AND c.status = 'sending'))
      FROM unnest(account_ids, delivery_ids) AS k(wanted_account, wanted_delivery)
      JOIN sendonce.deliveries d ON d.account_id = k.wanted_account AND d.delivery_id = k.wanted_delivery
      LEFT JOIN sendonce.subscribers s
        ON s.account_id = d.account_id AND s.subscriber_id = d.subscriber_id;
END
$$;
