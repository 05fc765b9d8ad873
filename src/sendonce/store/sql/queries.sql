-- Every runtime query of sendonce, one named block each: "-- name --", a comment saying what it
-- does, then the statement. Parsed once at import by sendonce.store.queries. Parameters only, never
-- formatted values.
--
-- %(name)b instead of %(name)s: the parameter goes in PostgreSQL's binary format. Used for the arrays
-- of the statements a worker runs for every group of messages (claim, record, renew, release):
-- psycopg writes a list of numbers or timestamps in binary several times faster than as text
-- (a 12-row record_sent: ~80 µs less client CPU per call on the benchmark machine).

-- create_account --
-- A new account; the API key's secret part is hashed by the caller.
INSERT INTO sendonce.accounts (name, api_key_hash, from_email, from_name)
VALUES (%(name)s, %(api_key_hash)s, %(from_email)s, %(from_name)s)
RETURNING account_id;

-- get_account --
-- The account an API key names, with what authentication and mail composition need.
SELECT account_id, name, api_key_hash, from_email, from_name, signup_window, signup_list_id,
       dkim_domain, dkim_selector, dkim_key_file, dkim_key_env
  FROM sendonce.accounts
 WHERE account_id = %(account_id)s;

-- update_account_settings --
-- Change an account's settings; a NULL keeps the current value.
UPDATE sendonce.accounts
   SET signup_window = CASE WHEN %(clear_window)s THEN NULL ELSE coalesce(%(signup_window)s, signup_window) END,
       signup_list_id = coalesce(%(signup_list_id)s, signup_list_id),
       from_name = coalesce(%(from_name)s, from_name),
       dkim_domain = CASE WHEN %(set_dkim)s THEN %(dkim_domain)s ELSE dkim_domain END,
       dkim_selector = CASE WHEN %(set_dkim)s THEN %(dkim_selector)s ELSE dkim_selector END,
       dkim_key_file = CASE WHEN %(set_dkim)s THEN %(dkim_key_file)s ELSE dkim_key_file END,
       dkim_key_env = CASE WHEN %(set_dkim)s THEN %(dkim_key_env)s ELSE dkim_key_env END
 WHERE account_id = %(account_id)s
RETURNING account_id, name, from_email, from_name, signup_window, signup_list_id,
          dkim_domain, dkim_selector, dkim_key_file, dkim_key_env;

-- create_list --
-- A new list, single or double opt-in.
INSERT INTO sendonce.lists (account_id, name, opt_in)
VALUES (%(account_id)s, %(name)s, %(opt_in)s)
RETURNING list_id;

-- existing_lists --
-- Which of the given list ids exist in this account.
SELECT list_id
  FROM sendonce.lists
 WHERE account_id = %(account_id)s AND list_id = ANY(%(list_ids)s::bigint[]);

-- insert_subscribers --
-- New subscribers; addresses that exist already are left for update_subscribers.
INSERT INTO sendonce.subscribers (account_id, email, email_key, name, status, attributes)
SELECT %(account_id)s, u.email, u.email_key, u.name, coalesce(u.status, 'confirmed'), coalesce(u.attributes, '{}')
  FROM unnest(%(emails)s::text[], %(email_keys)s::text[], %(names)s::text[],
              %(statuses)s::sendonce.subscriber_status[], %(attributes)s::jsonb[])
       AS u(email, email_key, name, status, attributes)
ON CONFLICT (account_id, email_key) DO NOTHING
RETURNING subscriber_id, email_key;

-- update_subscribers --
-- Existing subscribers: a field that was not given keeps its value. Nor does a status given bring back
-- someone who unsubscribed or bounced (as confirm_subscriber, their choice or their mailbox wins): an
-- export whose every row says "confirmed", imported again, re-confirmed them, and the next campaign
-- mailed people who had opted out. Unless %(resubscribe)s: the caller says they consented again.
-- status_kept: a status was asked for and refused so.
UPDATE sendonce.subscribers s
   SET name = coalesce(u.name, s.name),
       status = CASE WHEN NOT %(resubscribe)s AND s.status IN ('unsubscribed', 'bounced')
                          AND u.status IN ('pending', 'confirmed')
                     THEN s.status ELSE coalesce(u.status, s.status) END,
       attributes = s.attributes || coalesce(u.attributes, '{}'),
       updated_at = now()
  FROM unnest(%(email_keys)s::text[], %(names)s::text[],
              %(statuses)s::sendonce.subscriber_status[], %(attributes)s::jsonb[])
       AS u(email_key, name, status, attributes)
 WHERE s.account_id = %(account_id)s AND s.email_key = u.email_key
RETURNING s.subscriber_id, s.email_key, coalesce(u.status <> s.status, false) AS status_kept, s.status;

-- add_memberships --
-- List memberships; an existing one (even unsubscribed) is left as it is. A new membership of a
-- double opt-in list is pending until its confirmation link is used, unless the caller vouches for
-- the consent (preconfirm). Returns the new pending memberships: each needs its confirmation mail.
INSERT INTO sendonce.list_members AS m (account_id, list_id, subscriber_id, status)
SELECT %(account_id)s, u.list_id, u.subscriber_id,
       CASE WHEN l.opt_in = 'double' AND NOT %(preconfirm)s THEN 'pending' ELSE 'confirmed' END::sendonce.membership_status
  FROM unnest(%(list_ids)s::bigint[], %(subscriber_ids)s::bigint[]) AS u(list_id, subscriber_id)
  JOIN sendonce.lists l ON l.account_id = %(account_id)s AND l.list_id = u.list_id
 ORDER BY u.list_id, u.subscriber_id
ON CONFLICT (account_id, list_id, subscriber_id) DO UPDATE
   -- vouched-for consent confirms a membership still pending; nothing else is changed
   SET status = 'confirmed', updated_at = now()
 WHERE %(preconfirm)s AND m.status = 'pending'
RETURNING list_id, subscriber_id, status;

-- renew_stale_optins --
-- Pending memberships among those given whose last confirmation mail can no longer confirm them: it
-- certainly reached nobody (failed, and no attempt of it may have arrived), its link has expired (a
-- mail sent or failed longer ago than the link's life), or it is gone (pruned). Each moves to its next
-- round, by compare-and-set on the round read, and the caller queues that round's mail in the same
-- transaction, under the round's job id: of requests that race, one moves it and one mail is queued
-- (upserts of one subscriber also wait for each other on its row, which they write first). Rounds stop
-- at max_round: a sync that adds everyone again every week must not mail someone who never confirms
-- every week for ever. A mail still on its way, or one suppressed, is left alone.
WITH stale AS (
    SELECT DISTINCT m.list_id, m.subscriber_id, m.optin_round
      FROM unnest(%(list_ids)s::bigint[], %(subscriber_ids)s::bigint[]) AS u(list_id, subscriber_id)
      JOIN sendonce.lists l ON l.account_id = %(account_id)s AND l.list_id = u.list_id AND l.opt_in = 'double'
      JOIN sendonce.list_members m
        ON m.account_id = l.account_id AND m.list_id = u.list_id AND m.subscriber_id = u.subscriber_id
      LEFT JOIN sendonce.deliveries d
        ON d.account_id = m.account_id AND d.job_id = sendonce.optin_job_id(m.list_id, m.subscriber_id, m.optin_round)
     WHERE m.status = 'pending'
       AND m.optin_round < %(max_round)s
       AND ((d.delivery_id IS NULL  -- pruned: judged by the round's age
             AND coalesce(m.round_started_at, m.created_at)
                 < now() - make_interval(secs => %(link_life_seconds)s::double precision))
            OR (d.status = 'failed' AND NOT d.uncertain)
            OR (d.status IN ('sent', 'failed')
                AND d.created_at < now() - make_interval(secs => %(link_life_seconds)s::double precision)))
)
UPDATE sendonce.list_members m
   SET optin_round = s.optin_round + 1, round_started_at = now()
  FROM stale s
 WHERE m.account_id = %(account_id)s AND m.list_id = s.list_id AND m.subscriber_id = s.subscriber_id
   AND m.status = 'pending' AND m.optin_round = s.optin_round
RETURNING m.list_id, m.subscriber_id, m.optin_round;

-- enqueue_optin_confirmations --
-- The confirmation mail of each pending membership given, in its round, through the outbox. The job
-- id names the membership and the round, so however often the subscriber is added, one confirmation
-- mail is queued per round.
INSERT INTO sendonce.deliveries (account_id, job_id, kind, priority, email, email_key, payload)
SELECT %(account_id)s, sendonce.optin_job_id(u.list_id, u.subscriber_id, u.round), 'list_confirmation_requested', 0,
       s.email, s.email_key,
       jsonb_build_object('list_id', u.list_id, 'list_name', l.name, 'subscriber_id', u.subscriber_id,
                          'name', s.name, 'confirm_url', u.url)
  FROM unnest(%(list_ids)s::bigint[], %(subscriber_ids)s::bigint[], %(rounds)s::int[], %(urls)s::text[])
       AS u(list_id, subscriber_id, round, url)
  JOIN sendonce.subscribers s ON s.account_id = %(account_id)s AND s.subscriber_id = u.subscriber_id
  JOIN sendonce.lists l ON l.account_id = %(account_id)s AND l.list_id = u.list_id
ON CONFLICT DO NOTHING
RETURNING delivery_id;

-- confirm_optin --
-- CAS pending -> confirmed for one membership. No row: confirmed already (or left, or unknown).
UPDATE sendonce.list_members
   SET status = 'confirmed', updated_at = now()
 WHERE account_id = %(account_id)s AND list_id = %(list_id)s AND subscriber_id = %(subscriber_id)s
   AND status = 'pending'
RETURNING list_id;

-- membership --
-- One membership, with its list's name.
SELECT m.status, l.name AS list_name
  FROM sendonce.list_members m
  JOIN sendonce.lists l ON l.account_id = m.account_id AND l.list_id = m.list_id
 WHERE m.account_id = %(account_id)s AND m.list_id = %(list_id)s AND m.subscriber_id = %(subscriber_id)s;

-- create_campaign --
-- A new campaign, as a draft.
INSERT INTO sendonce.campaigns (account_id, name, subject, text_body, html_body, from_email, from_name,
                                template_id, max_bounce_rate, max_complaint_rate)
VALUES (%(account_id)s, %(name)s, %(subject)s, %(text_body)s, %(html_body)s, %(from_email)s, %(from_name)s,
        %(template_id)s, %(max_bounce_rate)s, %(max_complaint_rate)s)
RETURNING campaign_id, status;

-- add_campaign_lists --
-- The lists a campaign goes to.
INSERT INTO sendonce.campaign_lists (account_id, campaign_id, list_id)
SELECT %(account_id)s, %(campaign_id)s, unnest(%(list_ids)s::bigint[])
ON CONFLICT DO NOTHING;

-- get_campaign --
-- One campaign, with its content and lists.
SELECT c.account_id, c.campaign_id, c.name, c.subject, c.text_body, c.html_body, c.from_email,
       c.from_name, c.status, c.scheduled_for, c.started_at, c.finished_at, c.built_at, c.created_at,
       c.template_id, c.paused_reason,
       ARRAY(SELECT l.list_id FROM sendonce.campaign_lists l
              WHERE l.account_id = c.account_id AND l.campaign_id = c.campaign_id
              ORDER BY l.list_id) AS list_ids
  FROM sendonce.campaigns c
 WHERE c.account_id = %(account_id)s AND c.campaign_id = %(campaign_id)s;

-- campaign_status --
-- The status of one campaign (only to explain a compare-and-set that lost; never to decide one).
SELECT status FROM sendonce.campaigns WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s;

-- approve_campaign --
-- CAS draft -> approved. Zero rows back: not a draft (or not this account's).
UPDATE sendonce.campaigns
   SET status = 'approved', scheduled_for = coalesce(%(scheduled_for)s, now()), updated_at = now()
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s AND status = 'draft'
RETURNING campaign_id, status, scheduled_for;

-- pause_campaign --
-- CAS approved|sending -> paused. Workers stop claiming its rows and release claimed rows they have
-- not started at their next lease renewal.
UPDATE sendonce.campaigns
   SET status = 'paused', paused_reason = NULL, updated_at = now()
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s AND status IN ('approved', 'sending')
RETURNING campaign_id, status, scheduled_for;

-- resume_campaign --
-- CAS paused -> sending, or -> approved when it had not started yet; the reason of the pause goes.
UPDATE sendonce.campaigns
   SET status = CASE WHEN started_at IS NULL THEN 'approved' ELSE 'sending' END::sendonce.campaign_status,
       paused_reason = NULL, updated_at = now()
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s AND status = 'paused'
RETURNING campaign_id, status, scheduled_for;

-- cancel_campaign --
-- CAS draft|approved|sending|paused -> cancelled. Its queued rows stay queued and are never claimed.
UPDATE sendonce.campaigns
   SET status = 'cancelled', finished_at = now(), updated_at = now()
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s
   AND status IN ('draft', 'approved', 'sending', 'paused')
RETURNING campaign_id, status, scheduled_for;

-- campaign_counts --
-- Deliveries of one campaign by status, and how many may have reached their recipient twice, in
-- one snapshot. total is the sum of the five statuses: there is no other.
SELECT count(*) FILTER (WHERE status = 'queued') AS queued,
       count(*) FILTER (WHERE status = 'sending') AS sending,
       count(*) FILTER (WHERE status = 'sent') AS sent,
       count(*) FILTER (WHERE status = 'suppressed') AS suppressed,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       -- suppressed or failed, but an earlier attempt may have reached the recipient (its worker
       -- died after the transport took the message, or the transport's answer was lost)
       count(*) FILTER (WHERE status IN ('suppressed', 'failed') AND uncertain) AS possibly_delivered,
       (SELECT count(DISTINCT p.delivery_id) FROM sendonce.possible_duplicates p
         WHERE p.account_id = %(account_id)s AND p.campaign_id = %(campaign_id)s) AS possible_duplicate
  FROM sendonce.deliveries
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s;

-- list_possible_duplicates --
-- The ledger, newest first, optionally for one campaign.
SELECT p.delivery_id, p.job_id, p.campaign_id, p.attempt, p.reason, p.recorded_at, d.email, d.status
  FROM sendonce.possible_duplicates p
  JOIN sendonce.deliveries d USING (account_id, delivery_id)
 WHERE p.account_id = %(account_id)s
   AND (%(campaign_id)s::bigint IS NULL OR p.campaign_id = %(campaign_id)s::bigint)
 ORDER BY p.recorded_at DESC, p.delivery_id DESC
 LIMIT %(limit)s;

-- add_suppression --
-- Suppress an address for the account. Idempotent: the first reason and time are kept.
INSERT INTO sendonce.suppressions (account_id, email_key, email, reason)
VALUES (%(account_id)s, %(email_key)s, %(email)s, %(reason)s)
ON CONFLICT (account_id, email_key) DO NOTHING
RETURNING email_key;

-- delete_suppression --
-- Lift a suppression.
DELETE FROM sendonce.suppressions
 WHERE account_id = %(account_id)s AND email_key = %(email_key)s
RETURNING email_key;

-- start_due_campaigns --
-- The seed's compare-and-set: approved -> sending once scheduled_for has come. Of two workers that
-- run this at the same instant, one gets the row back and the other gets nothing.
UPDATE sendonce.campaigns
   SET status = 'sending', started_at = coalesce(started_at, now()), updated_at = now()
 WHERE status = 'approved' AND scheduled_for <= now()
RETURNING account_id, campaign_id;

-- lock_campaign_to_build --
-- One sending campaign whose recipient list is not complete, locked for one build chunk. SKIP
-- LOCKED: two workers never build the same chunk; the other one goes on to send.
SELECT account_id, campaign_id, build_cursor
  FROM sendonce.campaigns
 WHERE status = 'sending' AND built_at IS NULL
 ORDER BY scheduled_for, campaign_id
 LIMIT 1
   FOR UPDATE SKIP LOCKED;

-- lists_to_build --
-- Whether any sending campaign's recipient list is still incomplete (locked by a builder or not).
SELECT EXISTS (SELECT 1 FROM sendonce.campaigns WHERE status = 'sending' AND built_at IS NULL) AS pending;

-- build_chunk --
-- Add the recipients among the next chunk_size subscribers of the account (by subscriber_id) to a
-- campaign, in the same transaction as the lock above, and move the build cursor past that span.
-- The span is read first, by the primary key, and materialized: every chunk costs the same (one
-- index range scan, then per-row probes of the memberships and suppressions), whatever the list's
-- size and whatever the planner's statistics say. (Limiting the *qualifying* rows instead lets the
-- planner hash every membership after the cursor for each chunk when its estimates are off, as they
-- are after a bulk import: measured, a 1,000,000-recipient list then built at ~1,200 rows a second.)
-- ON CONFLICT DO NOTHING makes a rebuild after a crash create nothing twice. An address in several
-- lists is one subscriber row (the EXISTS collapses the lists), and subscribers are unique by
-- email_key, so DISTINCT ON (email_key) changes nothing today: it is the seed's defence in depth,
-- kept so that this statement alone, whatever the schema around it, never sends one address two
-- messages (the unique index deliveries_one_per_address is the last line behind it).
WITH span AS MATERIALIZED (
    SELECT s.account_id, s.subscriber_id, s.email, s.email_key, s.status
      FROM sendonce.subscribers s
     WHERE s.account_id = %(account_id)s
       AND s.subscriber_id > %(after)s
     ORDER BY s.subscriber_id
     LIMIT %(chunk_size)s
), chunk AS (
    -- confirmed subscribers with a confirmed membership in one of the campaign's lists, not suppressed
    SELECT w.account_id, w.subscriber_id, w.email, w.email_key
      FROM span w
     WHERE w.status = 'confirmed'
       AND EXISTS (SELECT 1
                     FROM sendonce.list_members m
                     JOIN sendonce.campaign_lists cl
                       ON cl.account_id = m.account_id AND cl.list_id = m.list_id
                    WHERE m.account_id = w.account_id AND m.subscriber_id = w.subscriber_id
                      AND m.status = 'confirmed' AND cl.campaign_id = %(campaign_id)s)
       AND NOT EXISTS (SELECT 1 FROM sendonce.suppressions x
                        WHERE x.account_id = w.account_id AND x.email_key = w.email_key)
), inserted AS (
    INSERT INTO sendonce.deliveries (account_id, job_id, kind, priority, campaign_id, subscriber_id,
                                     email, email_key)
    SELECT DISTINCT ON (c.email_key)
           c.account_id, 'campaign:' || %(campaign_id)s::bigint || ':' || c.subscriber_id, 'campaign', 100,
           %(campaign_id)s, c.subscriber_id, c.email, c.email_key
      FROM chunk c
     ORDER BY c.email_key, c.subscriber_id
    ON CONFLICT DO NOTHING
    RETURNING 1
), advanced AS (
    -- CAS on the cursor as well as the row lock: a chunk is committed once, in order.
    UPDATE sendonce.campaigns
       SET build_cursor = coalesce((SELECT max(subscriber_id) FROM span), build_cursor),
           built_at = CASE WHEN (SELECT count(*) FROM span) < %(chunk_size)s THEN now() END,
           updated_at = now()
     WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s AND build_cursor = %(after)s
    RETURNING build_cursor, built_at
)
SELECT (SELECT count(*) FROM span) AS examined,
       (SELECT count(*) FROM inserted) AS inserted,
       (SELECT build_cursor FROM advanced) AS cursor,
       (SELECT built_at FROM advanced) AS built_at;

-- finish_campaigns --
-- CAS sending -> sent, for campaigns whose list is built and that have no open delivery left.
-- "Open" is asked as "the first queued row, the first leased row, in the order of the partial
-- index that holds only such rows": ordered like those indexes, the cheapest plan is to read the
-- first entry of each (the planner still decides; test_housekeeping_reads_only_open_rows holds it to
-- that on the statistics of a young campaign). As NOT EXISTS (status IN (...), or one per state) the
-- planner walked every delivery of the campaign, sent ones included: 146 ms a round at 1,000,000
-- recipients.
UPDATE sendonce.campaigns c
   SET status = 'sent', finished_at = now(), updated_at = now()
 WHERE c.status = 'sending' AND c.built_at IS NOT NULL
   AND (SELECT 1 FROM sendonce.deliveries d
         WHERE d.status = 'queued' AND d.campaign_id IS NOT NULL
           AND d.account_id = c.account_id AND d.campaign_id = c.campaign_id
         ORDER BY d.not_before, d.delivery_id LIMIT 1) IS NULL
   AND (SELECT 1 FROM sendonce.deliveries d
         WHERE d.status = 'sending' AND d.account_id = c.account_id AND d.campaign_id = c.campaign_id
         ORDER BY d.lease_expires_at LIMIT 1) IS NULL
RETURNING account_id, campaign_id;

-- requeue_expired --
-- Rows whose lease ran out (their worker died, hung, or lost the database) go back to the queue,
-- flagged uncertain: the dead attempt may have reached the recipient. The attempt (fencing token)
-- is kept, so the old worker can still record an outcome it really got until someone re-claims.
-- They keep their place near the front of their queue, behind the workers' claim cursors: the
-- NOTIFY (sent once, at commit, only if rows were requeued) makes every worker start its next claim
-- from the front, so they go out now rather than at the end of the campaign.
-- The doubt dates from the claim, not from now: this may run long after the attempt (no worker was
-- running, the database was down), and an idempotency key's life counts from the send. While a row
-- is 'sending', updated_at is its claim's time (renewals move only the lease).
WITH expired AS (
    SELECT account_id, delivery_id
      FROM sendonce.deliveries
     WHERE status = 'sending' AND lease_expires_at < now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE sendonce.deliveries d
       SET status = 'queued', uncertain = true, uncertain_since = coalesce(d.uncertain_since, d.updated_at),
           lease_expires_at = NULL, updated_at = now()
      FROM expired e
     WHERE d.account_id = e.account_id AND d.delivery_id = e.delivery_id
    RETURNING d.account_id, d.delivery_id, d.job_id, d.attempt, d.claimed_by
)
SELECT r.*, (SELECT pg_notify('sendonce_work', 'requeued')) IS NULL AS notified FROM requeued r;

-- claim_batch --
-- Claim up to %(limit)s due deliveries for one worker, transactional mail first, in one statement.
-- Rows of an address that is suppressed, or of a subscriber who left, end 'suppressed' right here,
-- before any network call. Returns what the worker needs to compose and fence each message.
WITH transactional AS (
    -- Due transactional rows by priority. SKIP LOCKED: a row another claimer is taking right now
    -- is skipped, not waited for, so concurrent claims are disjoint and never block each other.
    SELECT d.account_id, d.delivery_id
      FROM sendonce.deliveries d
     WHERE d.status = 'queued' AND d.campaign_id IS NULL AND d.not_before <= now()
     ORDER BY d.priority, d.not_before, d.delivery_id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), after AS (
    -- Where this worker's previous claim of each campaign ended (its cursor; none: the front).
    SELECT * FROM unnest(%(after_accounts)b::bigint[], %(after_campaigns)b::bigint[],
                         %(after_not_befores)b::timestamptz[], %(after_deliveries)b::bigint[])
           AS k(account_id, campaign_id, not_before, delivery_id)
), campaign_rows AS (
    -- Then rows of campaigns that are sending; a paused or cancelled campaign's rows are never
    -- claimed. The lateral walk uses the per-campaign queue index, so a paused campaign with a
    -- million queued rows costs nothing here. It starts after the worker's cursor: the index
    -- entries before it are mostly rows claimed already, dead until a vacuum removes them, and
    -- walking past them from the front made each claim of a large campaign slower than the last.
    -- Rows behind the cursor (given back, or whose lease expired) are taken when nothing is left
    -- ahead of it: the second branch runs only if the first did not fill the batch.
    -- Accounts take turns: claim number %(turn)s of a worker starts with the next account that has a
    -- campaign sending, each account's campaigns in their order. In schedule order alone, one
    -- account's campaign filled every claim until its queue was empty, and every other account's
    -- campaigns waited behind it (a million recipients: half an hour and more).
    SELECT r.account_id, r.delivery_id
      FROM (SELECT s.account_id, s.campaign_id, s.after_not_before, s.after_delivery_id
              FROM (SELECT c.account_id, c.campaign_id, c.scheduled_for,
                           coalesce(k.not_before, '-infinity') AS after_not_before,
                           coalesce(k.delivery_id, 0) AS after_delivery_id,
                           dense_rank() OVER (ORDER BY c.account_id) AS account_rank
                      FROM sendonce.campaigns c
                      LEFT JOIN after k ON k.account_id = c.account_id AND k.campaign_id = c.campaign_id
                     WHERE c.status = 'sending') s
             ORDER BY mod(s.account_rank + %(turn)s::bigint, max(s.account_rank) OVER ()),
                      s.scheduled_for, s.campaign_id) c
     CROSS JOIN LATERAL (
            SELECT * FROM (
                SELECT d.account_id, d.delivery_id
                  FROM sendonce.deliveries d
                 WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
                   AND d.status = 'queued' AND d.not_before <= now()
                   AND (d.not_before, d.delivery_id) > (c.after_not_before, c.after_delivery_id)
                 ORDER BY d.not_before, d.delivery_id
                 LIMIT %(limit)s
                   FOR UPDATE OF d SKIP LOCKED) ahead
            UNION ALL
            SELECT * FROM (
                SELECT d.account_id, d.delivery_id
                  FROM sendonce.deliveries d
                 WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
                   AND d.status = 'queued' AND d.not_before <= now()
                   AND (d.not_before, d.delivery_id) <= (c.after_not_before, c.after_delivery_id)
                 ORDER BY d.not_before, d.delivery_id
                 LIMIT %(limit)s
                   FOR UPDATE OF d SKIP LOCKED) behind
            LIMIT %(limit)s) r
     LIMIT %(limit)s
), picked AS MATERIALIZED (
    -- Every row of this claim, locked. MATERIALIZED: it is read twice below, and must be one set.
    SELECT account_id, delivery_id FROM transactional
    UNION ALL
    (SELECT account_id, delivery_id FROM campaign_rows
      LIMIT greatest(%(limit)s - (SELECT count(*) FROM transactional), 0))
), checked AS MATERIALIZED (
    -- Suppressions and opt-outs are re-checked inside the claim: an opt-out that landed mid-campaign
    -- removes the recipient before the network call; and so is the campaign's status: a row of a
    -- campaign paused or cancelled meanwhile is not claimed. Not here, in this statement's snapshot,
    -- which is older than the row locks taken above: claim_check (migration 0006) reads in a
    -- snapshot of its own, taken after every row of the claim is locked, so it sees every opt-out
    -- and every pause that committed before the claim took the row. Its arguments hold all of
    -- "picked": they are computed, and the rows locked, before it runs. MATERIALIZED: called once,
    -- whatever plan the UPDATE gets.
    SELECT * FROM sendonce.claim_check(ARRAY(SELECT account_id FROM picked ORDER BY delivery_id),
                                       ARRAY(SELECT delivery_id FROM picked ORDER BY delivery_id))
), claimed AS (
    -- The claim itself: a lease, and a new fencing token (attempt + 1).
    UPDATE sendonce.deliveries d
       SET status = CASE WHEN c.blocked THEN 'suppressed' ELSE 'sending' END::sendonce.delivery_status,
           attempt = d.attempt + 1,
           lease_expires_at = CASE WHEN c.blocked THEN NULL
                                   ELSE now() + make_interval(secs => %(lease_seconds)s) END,
           claimed_by = %(worker)s,
           last_error = CASE WHEN c.blocked THEN 'suppressed or unsubscribed at claim time' ELSE d.last_error END,
           updated_at = now()
      FROM checked c
     WHERE d.account_id = c.account_id AND d.delivery_id = c.delivery_id AND c.claimable
 RETURNING d.account_id, d.delivery_id, d.job_id, d.kind, d.campaign_id, d.subscriber_id, d.email,
           d.payload, d.attempt, d.failures, d.uncertain, d.uncertain_since, c.blocked, c.name, c.attributes,
           d.not_before
), ledger AS (
    -- A re-send of an attempt that may have reached the recipient, through a transport without
    -- idempotency keys, or through one whose key the provider may have forgotten by now (the doubt
    -- began longer ago than %(key_life_seconds)s, the key's life less a margin; NULL: keys never
    -- expire): written down now, before the network call, so it is never silent.
    -- 'uncertain' stays set until a send succeeds: after a clean rejection of the re-send, the next
    -- try is still a possible duplicate of the first.
    INSERT INTO sendonce.possible_duplicates (account_id, delivery_id, attempt, job_id, campaign_id, reason)
    SELECT account_id, delivery_id, attempt, job_id, campaign_id,
           CASE WHEN %(transport_idempotent)s THEN 'resend_after_idempotency_key_expired'
                ELSE 'resend_after_uncertain_attempt' END
      FROM claimed
     WHERE uncertain AND NOT blocked
       AND (NOT %(transport_idempotent)s
            OR uncertain_since < now() - make_interval(secs => %(key_life_seconds)s::float8))
)
-- the columns of ClaimedDelivery, in the order of its fields
SELECT account_id, delivery_id, job_id, kind, campaign_id, subscriber_id, email, payload, attempt,
       failures, blocked, uncertain, name, attributes, not_before
  FROM claimed
 ORDER BY delivery_id;

-- renew_leases --
-- Extend the leases a worker still holds, fenced by attempt. Only the lease: updated_at stays the
-- claim's time, which dates the doubt of an attempt whose outcome is unknown (requeue_expired).
-- SKIP LOCKED: a row the worker's own recorder is completing at this moment is skipped rather than
-- waited for, so renewal and recording never deadlock on rows they take in different orders. A row
-- can also be locked for an instant by another worker's claim (a FOR UPDATE that meets a row just
-- claimed keeps its lock until its statement ends, even though it then skips the row), so a skipped
-- row is not a lost one: held_busy, run next for the rows not answered here, tells which of them
-- are still this worker's. campaign_active is false when its campaign was paused or cancelled, so the
-- worker can release what it has not started (and held_unwanted names the rows whose recipient opted
-- out since the claim).
WITH held AS (
    SELECT * FROM unnest(%(account_ids)b::bigint[], %(delivery_ids)b::bigint[], %(attempts)b::int[])
           AS u(account_id, delivery_id, attempt)
), mine AS (
    SELECT d.account_id, d.delivery_id
      FROM sendonce.deliveries d
      JOIN held u
        ON d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
     WHERE d.status = 'sending'
       FOR UPDATE OF d SKIP LOCKED
), renewed AS (
    UPDATE sendonce.deliveries d
       SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
      FROM mine
     WHERE d.account_id = mine.account_id AND d.delivery_id = mine.delivery_id
    RETURNING d.account_id, d.delivery_id, d.campaign_id
)
SELECT r.account_id, r.delivery_id,
       (r.campaign_id IS NULL OR EXISTS (SELECT 1 FROM sendonce.campaigns c
                                          WHERE c.account_id = r.account_id
                                            AND c.campaign_id = r.campaign_id
                                            AND c.status = 'sending')) AS campaign_active
  FROM renewed r;

-- held_busy --
-- Of the rows renew_leases did not renew (another transaction held their lock for a moment), those
-- still this worker's ('sending', same attempt): not renewed this time, not lost. Without locking.
-- A row in neither answer is no longer this worker's: it must not be sent. A statement of its own,
-- for the skipped rows only (most renewals skip none): as an anti-join of two sets of held rows in
-- one statement it was a nested loop (worker sessions plan without hash joins), 3.8 s at 10,000 rows.
SELECT d.account_id, d.delivery_id,
       (d.campaign_id IS NULL OR EXISTS (SELECT 1 FROM sendonce.campaigns c
                                          WHERE c.account_id = d.account_id
                                            AND c.campaign_id = d.campaign_id
                                            AND c.status = 'sending')) AS campaign_active
  FROM unnest(%(account_ids)b::bigint[], %(delivery_ids)b::bigint[], %(attempts)b::int[])
       AS u(account_id, delivery_id, attempt)
  JOIN sendonce.deliveries d
    ON d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
 WHERE d.status = 'sending';

-- held_unwanted --
-- Of the rows a worker holds, those it must not send any more: the claim's own test (claim_check),
-- made again at each lease renewal. A row held while the transport is down (its lanes pausing for
-- minutes) is renewed, not claimed again; its recipient may have been suppressed, unsubscribed or
-- left the campaign's lists meanwhile, and the worker gives back what it has not started (its
-- re-claim settles it). A statement of its own, not a join in renew_leases: worker sessions plan
-- without hash joins, and a join of two sets of held rows is a nested loop, quadratic in their number.
SELECT k.account_id, k.delivery_id
  FROM sendonce.claim_check(%(account_ids)b::bigint[], %(delivery_ids)b::bigint[]) k
 WHERE k.blocked OR NOT k.claimable;

-- record_sent --
-- The transport accepted these messages. Fenced: only the attempt that was claimed can complete
-- its row, so a worker presumed dead cannot complete a row that someone else re-claimed. A row
-- whose lease expired but that nobody re-claimed yet ('queued' with the same attempt) is completed
-- too: that worker really sent it, and recording it spares the recipient a second copy.
UPDATE sendonce.deliveries d
   SET status = 'sent', sent_at = u.sent_at, transport_message_id = u.message_id,
       lease_expires_at = NULL, uncertain = false, uncertain_since = NULL, last_error = NULL, updated_at = now()
  FROM unnest(%(account_ids)b::bigint[], %(delivery_ids)b::bigint[], %(attempts)b::int[],
              %(message_ids)b::text[], %(sent_ats)b::timestamptz[])
       AS u(account_id, delivery_id, attempt, message_id, sent_at)
 WHERE d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
   AND d.status IN ('sending', 'queued')
RETURNING d.account_id, d.delivery_id;

-- record_retry --
-- Transient failures: back to the queue after a backoff, fenced. uncertain when the transport
-- could not tell whether it accepted the message; that doubt dates from the claim (see
-- requeue_expired: the record may come long after the send). A failure counts once per attempt
-- (failure_attempt, migration 0008): the same group recorded again, after a commit whose answer was
-- lost, does not count it twice. A transport-wide failure (the relay down, our login refused, a rate
-- limit) is not counted at all (counted = false): it says nothing about the message.
UPDATE sendonce.deliveries d
   SET status = 'queued', not_before = now() + make_interval(secs => u.delay),
       failures = d.failures + CASE WHEN NOT u.counted OR d.failure_attempt IS NOT DISTINCT FROM u.attempt
                                    THEN 0 ELSE 1 END,
       failure_attempt = CASE WHEN u.counted THEN u.attempt ELSE d.failure_attempt END,
       last_error = u.error, uncertain = d.uncertain OR u.uncertain,
       uncertain_since = CASE WHEN u.uncertain THEN coalesce(d.uncertain_since, d.updated_at)
                              ELSE d.uncertain_since END,
       lease_expires_at = NULL, updated_at = now()
  FROM unnest(%(account_ids)s::bigint[], %(delivery_ids)s::bigint[], %(attempts)s::int[],
              %(delays)s::float8[], %(errors)s::text[], %(uncertain)s::bool[], %(counted)s::bool[])
       AS u(account_id, delivery_id, attempt, delay, error, uncertain, counted)
 WHERE d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
   AND d.status IN ('sending', 'queued')
RETURNING d.account_id, d.delivery_id;

-- record_failed --
-- Permanent failures, fenced. A hard bounce (the receiving server refused the recipient) is also
-- recorded as the delivery's feedback, for the campaign's bounce rate. uncertain: the worker gave up
-- after an attempt the transport may have taken (the row counts as possibly delivered).
UPDATE sendonce.deliveries d
   SET status = 'failed', last_error = u.error, lease_expires_at = NULL, updated_at = now(),
       feedback = CASE WHEN u.hard_bounce THEN 'hard_bounce' ELSE d.feedback END,
       feedback_at = CASE WHEN u.hard_bounce THEN now() ELSE d.feedback_at END,
       uncertain = d.uncertain OR u.uncertain,
       uncertain_since = CASE WHEN u.uncertain THEN coalesce(d.uncertain_since, d.updated_at)
                              ELSE d.uncertain_since END
  FROM unnest(%(account_ids)s::bigint[], %(delivery_ids)s::bigint[], %(attempts)s::int[],
              %(errors)s::text[], %(hard_bounces)s::bool[], %(uncertain)s::bool[])
       AS u(account_id, delivery_id, attempt, error, hard_bounce, uncertain)
 WHERE d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
   AND d.status IN ('sending', 'queued')
RETURNING d.account_id, d.delivery_id, d.email_key, d.email, d.subscriber_id, d.campaign_id;

-- release_claims --
-- Give back rows this worker claimed but never started (shutdown, pause, deadline passed), fenced.
-- The attempt is kept: the fencing token only ever grows.
WITH released AS (
    UPDATE sendonce.deliveries d
       SET status = 'queued', lease_expires_at = NULL, updated_at = now()
      FROM unnest(%(account_ids)b::bigint[], %(delivery_ids)b::bigint[], %(attempts)b::int[])
           AS u(account_id, delivery_id, attempt)
     WHERE d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
       AND d.status = 'sending'
    RETURNING d.delivery_id
)
SELECT count(*) AS n, pg_notify('sendonce_work', 'released') IS NULL AS notified FROM released;

-- suppress_bounced --
-- A hard bounce suppresses the address for the account and marks the subscriber bounced.
WITH added AS (
    INSERT INTO sendonce.suppressions (account_id, email_key, email, reason)
    SELECT %(account_id)s, u.email_key, u.email, 'bounce'
      FROM unnest(%(email_keys)s::text[], %(emails)s::text[]) AS u(email_key, email)
    ON CONFLICT (account_id, email_key) DO NOTHING
    RETURNING email_key
)
UPDATE sendonce.subscribers s
   SET status = 'bounced', updated_at = now()
 WHERE s.account_id = %(account_id)s AND s.email_key = ANY(%(email_keys)s::text[])
   AND s.status <> 'bounced';

-- next_wakeup --
-- When the next piece of work becomes due: a retry's backoff, a lease that expires, a scheduled
-- campaign. The worker sleeps until then (or until NOTIFY, or its tick), whichever comes first.
SELECT least(
         (SELECT min(not_before) FROM sendonce.deliveries
           WHERE status = 'queued' AND campaign_id IS NULL),
         (SELECT min(q.not_before)
            FROM sendonce.campaigns c
           CROSS JOIN LATERAL (SELECT d.not_before FROM sendonce.deliveries d
                                WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
                                  AND d.status = 'queued'
                                ORDER BY d.not_before LIMIT 1) q
           WHERE c.status = 'sending'),
         (SELECT min(lease_expires_at) FROM sendonce.deliveries WHERE status = 'sending'),
         (SELECT min(scheduled_for) FROM sendonce.campaigns WHERE status = 'approved')
       ) - now() AS wait;

-- open_work --
-- Whether anything is left for a draining worker: open deliveries that can still be sent (queued
-- or leased, of transactional mail or of sending campaigns), lists to build, campaigns to finish
-- or to start. Open transactional rows are asked for in the order of the partial indexes of open
-- rows (see finish_campaigns), so that the cheapest plan is not a walk of every mail ever sent.
SELECT (SELECT 1 FROM sendonce.deliveries WHERE status = 'queued' AND campaign_id IS NULL
         ORDER BY priority, not_before, delivery_id LIMIT 1) IS NOT NULL
    OR (SELECT 1 FROM sendonce.deliveries WHERE status = 'sending' AND campaign_id IS NULL
         ORDER BY lease_expires_at LIMIT 1) IS NOT NULL
    OR EXISTS (SELECT 1 FROM sendonce.campaigns c
                WHERE c.status = 'sending')
    OR EXISTS (SELECT 1 FROM sendonce.campaigns
                WHERE status = 'approved' AND scheduled_for <= now()) AS open;

-- upsert_signup --
-- The pending user of a signup, one per address and origin; later requests refresh the optional
-- fields. Locks the row: concurrent requests for one address and origin go one at a time from here.
INSERT INTO sendonce.signups AS s (account_id, email, email_key, origin, name, locale, redirect_url)
VALUES (%(account_id)s, %(email)s, %(email_key)s, %(origin)s, %(name)s, %(locale)s, %(redirect_url)s)
ON CONFLICT (account_id, email_key, origin) DO UPDATE
   SET name = coalesce(EXCLUDED.name, s.name),
       locale = coalesce(EXCLUDED.locale, s.locale),
       redirect_url = coalesce(EXCLUDED.redirect_url, s.redirect_url),
       updated_at = now()
RETURNING signup_id, status;

-- peek_repeat --
-- Whether the address is suppressed, and a repeat answered without a lock or a write: the signup
-- exists and the request would change none of its fields, and the signup is verified, or the window
-- under the current key is open (see lock_window) with its answer stored. signup_id NULL: nothing to
-- answer from, the request goes the locking way (a first request, new field values, a window run out
-- or whose mail certainly failed, a window that a transaction not yet committed is opening). Before
-- this, every repeat updated the signup row and locked the window row: it wrote to disk at its commit,
-- and concurrent repeats of one address went through that row one at a time. One statement, one
-- snapshot: it answers what was true then. (The worker re-checks suppressions when it claims the mail.)
SELECT EXISTS (SELECT 1 FROM sendonce.suppressions x
                WHERE x.account_id = %(account_id)s AND x.email_key = %(email_key)s) AS suppressed,
       r.signup_id, r.status, r.answer, r.open
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN LATERAL (
      SELECT s.signup_id, s.status, w.answer,
             w.opened_at > now() - %(window)s::interval
             AND NOT sendonce.window_ended(w.account_id, w.signup_id, w.window_id, w.generation, w.opened_at) AS open
        FROM sendonce.signups s
        LEFT JOIN sendonce.signup_windows w
          ON w.account_id = s.account_id AND w.operation_key = %(operation_key)s
       WHERE s.account_id = %(account_id)s AND s.email_key = %(email_key)s AND s.origin = %(origin)s
         AND (%(name)s::text IS NULL OR s.name IS NOT DISTINCT FROM %(name)s::text)
         AND (%(locale)s::text IS NULL OR s.locale IS NOT DISTINCT FROM %(locale)s::text)
         AND (%(redirect_url)s::text IS NULL OR s.redirect_url IS NOT DISTINCT FROM %(redirect_url)s::text)
         -- a standby (a failover under way) may lag behind a mail that failed on the primary: the
         -- locking way refuses to run there (503), and the client's retry reaches the primary
         AND NOT pg_is_in_recovery()
  ) AS r ON true;

-- lock_window --
-- The window of an operation under a given key, locked; open is true while it has not run out and
-- has not ended (sendonce.window_ended, migration 0011: its mail is certainly dead, or a later window
-- of the signup replaced it).
SELECT w.window_id, w.generation, w.answer,
       w.opened_at > now() - %(window)s::interval
       AND NOT sendonce.window_ended(w.account_id, w.signup_id, w.window_id, w.generation, w.opened_at) AS open
  FROM sendonce.signup_windows w
 WHERE w.account_id = %(account_id)s AND w.operation_key = %(operation_key)s
   FOR UPDATE OF w;

-- lock_latest_window --
-- The signup's latest window under any operation key, locked; open as in lock_window. A window opened
-- under another secret (before a rotation, or by a process with another secret) is still this
-- signup's window: while it is open, a request is a repeat of it (migration 0010). The caller holds
-- the signup row's lock (upsert_signup), so no window of this signup opens meanwhile.
SELECT w.operation_key, w.answer,
       w.opened_at > now() - %(window)s::interval
       AND NOT sendonce.window_ended(w.account_id, w.signup_id, w.window_id, w.generation, w.opened_at) AS open
  FROM sendonce.signup_windows w
 WHERE w.account_id = %(account_id)s AND w.signup_id = %(signup_id)s
 ORDER BY w.opened_at DESC
 LIMIT 1
   FOR UPDATE OF w;

-- signup_mail_dead --
-- Whether a pending signup's latest window ended with its mail certainly reaching nobody (failed or
-- suppressed, and no attempt that the transport may have taken): a client's retry of its request under
-- the same Idempotency-Key is then run again, as a retry without the key would be (open_window), rather
-- than answered the stored "queued" for a mail that is dead. No row: no such signup, or no window.
SELECT s.status = 'pending' AND sendonce.window_mail_dead(w.account_id, w.window_id, w.generation) AS dead
  FROM sendonce.signups s
  JOIN LATERAL (SELECT l.account_id, l.window_id, l.generation
                  FROM sendonce.signup_windows l
                 WHERE l.account_id = s.account_id AND l.signup_id = s.signup_id
                 ORDER BY l.opened_at DESC
                 LIMIT 1) w ON true
 WHERE s.account_id = %(account_id)s AND s.signup_id = %(signup_id)s;

-- open_window --
-- Open the operation's first window, or a new one if the last has run out (from its first request),
-- or if the last window's mail certainly reached nobody: it ended failed or suppressed, and no attempt
-- of it may have been taken by the transport (not uncertain), so a repeat asking again is not told
-- "queued" for a mail that is dead. A row back: this request opened a window (its generation numbers
-- it). No row: a window is open, and this request is a repeat. Atomic under concurrency: the
-- conflicting row is locked, and the condition is evaluated on its latest committed version.
-- answer: what the window's first request is answered, and every repeat after it (the transaction
-- that opens the window writes its mail too, or nothing at all).
-- opened_at is the clock's time, not the transaction's start (now()): windows of one signup open
-- one at a time, under its row lock, and the latest one (lock_latest_window) must be the last opened,
-- not the one whose transaction began last.
INSERT INTO sendonce.signup_windows AS w (account_id, operation_key, signup_id, answer, opened_at)
VALUES (%(account_id)s, %(operation_key)s, %(signup_id)s, %(answer)s, clock_timestamp())
ON CONFLICT (account_id, operation_key) DO UPDATE
   SET generation = w.generation + 1, opened_at = clock_timestamp(), answer = EXCLUDED.answer,
       signup_id = EXCLUDED.signup_id
 WHERE w.opened_at <= now() - %(window)s::interval
    OR sendonce.window_ended(w.account_id, w.signup_id, w.window_id, w.generation, w.opened_at)
RETURNING window_id, generation;

-- insert_operation --
-- The outbox event of a transactional operation, keyed by its operation key (and window). No id
-- back: the event exists already, this request is a repeat, nothing more is queued.
INSERT INTO sendonce.deliveries (account_id, job_id, kind, priority, email, email_key, payload, operation_key)
VALUES (%(account_id)s, %(job_id)s, %(kind)s, 0, %(email)s, %(email_key)s, %(payload)s, %(operation_key)s)
ON CONFLICT (account_id, operation_key) WHERE operation_key IS NOT NULL DO NOTHING
RETURNING delivery_id;

-- verify_signup --
-- CAS pending -> verified. No row back: already verified (or no such signup).
UPDATE sendonce.signups
   SET status = 'verified', verified_at = now(), updated_at = now()
 WHERE account_id = %(account_id)s AND signup_id = %(signup_id)s AND status = 'pending'
RETURNING signup_id, email, email_key, name, redirect_url, status;

-- window_asked_at --
-- When the verification mail a link came in was asked for: its window's opening, if the window is
-- still at the link's generation (a later request rewrites opened_at: the link of an earlier mail,
-- clicked after an unsubscribe that came between, must not be judged by it). No row: not known.
SELECT opened_at FROM sendonce.signup_windows
 WHERE account_id = %(account_id)s AND window_id = %(window_id)s AND signup_id = %(signup_id)s
   AND generation = %(generation)s;

-- get_signup --
-- One signup.
SELECT signup_id, email, email_key, name, origin, redirect_url, status, verified_at
  FROM sendonce.signups
 WHERE account_id = %(account_id)s AND signup_id = %(signup_id)s;

-- confirm_subscriber --
-- A verified signup becomes a confirmed subscriber. One who unsubscribed before asking for this
-- verification mail (%(asked_at)s, the signup window's request) has confirmed from their mailbox since:
-- confirmed again. One who unsubscribed after it (an old link clicked) or bounced is left as they are
-- (their latest choice, or their mailbox, wins); so is anyone when asked_at is NULL.
INSERT INTO sendonce.subscribers AS s (account_id, email, email_key, name, status)
VALUES (%(account_id)s, %(email)s, %(email_key)s, %(name)s, 'confirmed')
ON CONFLICT (account_id, email_key) DO UPDATE
   SET status = CASE WHEN s.status = 'pending' THEN 'confirmed'
                     WHEN s.status = 'unsubscribed' AND s.updated_at < %(asked_at)s
                          AND NOT EXISTS (SELECT 1 FROM sendonce.suppressions x
                                           WHERE x.account_id = %(account_id)s AND x.email_key = %(email_key)s)
                     THEN 'confirmed'
                     ELSE s.status END,
       name = coalesce(s.name, EXCLUDED.name),
       updated_at = now()
RETURNING subscriber_id;

-- confirm_membership --
-- A confirmed membership of the list; a pending one is confirmed, an unsubscribed one too if it was
-- left before the verification mail was asked for (as confirm_subscriber), else left alone. Neither
-- query confirms a suppressed address again (a complaint, say: lifting it later must not bring
-- back a membership the complaint ended).
INSERT INTO sendonce.list_members AS m (account_id, list_id, subscriber_id, status)
VALUES (%(account_id)s, %(list_id)s, %(subscriber_id)s, 'confirmed')
ON CONFLICT (account_id, list_id, subscriber_id) DO UPDATE
   SET status = CASE WHEN m.status = 'pending' THEN 'confirmed'
                     WHEN m.status = 'unsubscribed' AND coalesce(m.unsubscribed_at, m.updated_at) < %(asked_at)s
                          AND NOT EXISTS (SELECT 1 FROM sendonce.suppressions x
                                           WHERE x.account_id = %(account_id)s AND x.email_key = %(email_key)s)
                     THEN 'confirmed'
                     ELSE m.status END,
       updated_at = now();

-- enqueue_message --
-- A transactional message, in the caller's transaction. The job id is derived from the caller's
-- key: enqueueing the same key twice queues one message.
INSERT INTO sendonce.deliveries (account_id, job_id, kind, priority, email, email_key, payload, not_before)
VALUES (%(account_id)s, %(job_id)s, 'message', %(priority)s, %(email)s, %(email_key)s, %(payload)s,
        coalesce(%(not_before)s::timestamptz, now()))
ON CONFLICT (account_id, job_id) DO NOTHING
RETURNING delivery_id;

-- take_tokens --
-- Take tokens from a bucket that refills at rate per second up to capacity. A row back: taken. No
-- row: not enough tokens, nothing taken. One statement, so it holds across processes and hosts.
INSERT INTO sendonce.rate_buckets AS b (account_id, bucket, tokens, updated_at)
VALUES (%(account_id)s, %(bucket)s, %(capacity)s - %(cost)s, clock_timestamp())
ON CONFLICT (account_id, bucket) DO UPDATE
   SET tokens = least(%(capacity)s::float8,
                      b.tokens + extract(epoch FROM clock_timestamp() - b.updated_at) * %(rate)s) - %(cost)s,
       updated_at = clock_timestamp()
 WHERE least(%(capacity)s::float8, b.tokens + extract(epoch FROM clock_timestamp() - b.updated_at) * %(rate)s)
       >= %(cost)s
RETURNING tokens;

-- bucket_wait --
-- Seconds until a bucket holds enough tokens again.
SELECT greatest(0, (%(cost)s - least(%(capacity)s::float8,
                   tokens + extract(epoch FROM clock_timestamp() - updated_at) * %(rate)s)) / %(rate)s) AS wait
  FROM sendonce.rate_buckets
 WHERE account_id = %(account_id)s AND bucket = %(bucket)s;

-- insert_idempotency_key --
-- Reserve a client Idempotency-Key for this request, in the request's own transaction: a new key, or
-- one whose stored answer expired (24 h), which starts over as a new request. One statement: a
-- prune deleting the expired row meanwhile makes this an insert, not a lookup that finds nothing.
-- While the reserving transaction runs, a second request with the key waits on it (and is told 409
-- after lock_timeout). No row back: the key is live, and its row is locked (ON CONFLICT DO UPDATE
-- locks it even when its WHERE refuses the update).
INSERT INTO sendonce.idempotency_keys AS k
       (account_id, idempotency_key, request_hash, method, path, response_status, response_body, expires_at)
VALUES (%(account_id)s, %(key)s, %(request_hash)s, %(method)s, %(path)s, 0, '', now() + %(ttl)s::interval)
ON CONFLICT (account_id, idempotency_key) DO UPDATE
   SET request_hash = EXCLUDED.request_hash, method = EXCLUDED.method, path = EXCLUDED.path,
       response_status = 0, response_body = '', created_at = now(), expires_at = EXCLUDED.expires_at
 WHERE k.expires_at <= now()
RETURNING idempotency_key;

-- get_idempotency_key --
-- The stored answer of a live key (insert_idempotency_key locked it).
SELECT request_hash, method, path, response_status, response_body
  FROM sendonce.idempotency_keys
 WHERE account_id = %(account_id)s AND idempotency_key = %(key)s;

-- store_idempotent_response --
-- The answer to replay for this key.
UPDATE sendonce.idempotency_keys
   SET response_status = %(status)s, response_body = %(body)s
 WHERE account_id = %(account_id)s AND idempotency_key = %(key)s;

-- prune_idempotency_keys --
-- Forget stored answers past their expiry.
DELETE FROM sendonce.idempotency_keys WHERE expires_at < now() - interval '1 hour';

-- list_outbox --
-- An account's outbox, newest first, optionally for one event kind and since a time; paged by id.
SELECT delivery_id, job_id, kind, status, email, campaign_id, attempt, failures, created_at, sent_at,
       transport_message_id, last_error
  FROM sendonce.deliveries
 WHERE account_id = %(account_id)s
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(before)s::bigint IS NULL OR delivery_id < %(before)s::bigint)
 ORDER BY delivery_id DESC
 LIMIT %(limit)s;

-- prune_outbox --
-- Delete (returning them, for the archive) finished rows older than the cutoff: transactional mail,
-- and rows of campaigns that are over. Open rows and running campaigns are never touched.
WITH doomed AS (
    SELECT d.account_id, d.delivery_id
      FROM sendonce.deliveries d
     WHERE d.status IN ('sent', 'failed', 'suppressed')
       AND d.updated_at < now() - %(older_than)s::interval
       AND (d.campaign_id IS NULL
            OR EXISTS (SELECT 1 FROM sendonce.campaigns c
                        WHERE c.account_id = d.account_id AND c.campaign_id = d.campaign_id
                          AND c.status IN ('sent', 'cancelled')))
       -- The certainly failed mail of a signup's current window (its latest, at its current
       -- generation) stays, however old: a repeat reads it to queue the mail again (open_window);
       -- gone, the repeat would be told "queued" for a dead mail. Not whether the window is still
       -- open: that depends on a window length this command may not share with the API (a server
       -- default, an account's own), and one such row per signup is all it keeps.
       AND NOT (d.operation_key IS NOT NULL AND d.status IN ('failed', 'suppressed') AND NOT d.uncertain
                AND EXISTS (SELECT 1 FROM sendonce.signup_windows w
                             WHERE w.account_id = d.account_id
                               AND w.operation_key = split_part(d.operation_key, ':', 1)
                               AND d.operation_key = w.operation_key || ':' || w.generation
                               AND NOT EXISTS (SELECT 1 FROM sendonce.signup_windows later
                                                WHERE later.account_id = w.account_id
                                                  AND later.signup_id = w.signup_id
                                                  AND later.opened_at > w.opened_at)))
     ORDER BY d.delivery_id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), ledger AS (
    DELETE FROM sendonce.possible_duplicates p
     USING doomed x
     WHERE p.account_id = x.account_id AND p.delivery_id = x.delivery_id
    RETURNING p.delivery_id, p.attempt, p.reason, p.recorded_at
)
DELETE FROM sendonce.deliveries d
 USING doomed x
 WHERE d.account_id = x.account_id AND d.delivery_id = x.delivery_id
RETURNING d.account_id, d.delivery_id, d.job_id, d.kind, d.campaign_id, d.subscriber_id, d.email, d.status,
          d.uncertain, d.attempt, d.failures, d.created_at, d.sent_at, d.transport_message_id, d.last_error,
          d.payload,
          -- when it ended (for a failed row, its only date), what feedback it had, and what tied it
          -- to a signup's window: gone from the archive until 2026-12-04
          d.updated_at, d.uncertain_since, d.feedback, d.feedback_at, d.operation_key,
          (SELECT count(*) FROM ledger l WHERE l.delivery_id = d.delivery_id) AS ledger_entries,
          -- the possible-duplicate entries go with their row: the archive keeps them whole
          (SELECT coalesce(jsonb_agg(jsonb_build_object('attempt', l.attempt, 'reason', l.reason,
                                                        'recorded_at', l.recorded_at) ORDER BY l.attempt), '[]')
             FROM ledger l WHERE l.delivery_id = d.delivery_id) AS ledger;

-- raise_alert --
-- Record an alert once per account, kind, subject and episode. A row back: it is new.
INSERT INTO sendonce.alerts (account_id, kind, subject, episode, detail)
VALUES (%(account_id)s, %(kind)s, %(subject)s, %(episode)s, %(detail)s)
ON CONFLICT (account_id, kind, subject, episode) DO NOTHING
RETURNING alert_id, created_at;

-- list_alerts --
-- An account's alerts, newest first.
SELECT alert_id, kind, subject, detail, created_at
  FROM sendonce.alerts
 WHERE account_id = %(account_id)s
 ORDER BY alert_id DESC
 LIMIT %(limit)s;

-- unsubscribe_campaign_lists --
-- One-click unsubscribe: the subscriber leaves the lists the campaign went to, in the transaction that
-- answers, so a campaign still sending skips them from its next claimed batch on (the claim re-checks
-- memberships). Idempotent: nothing is left to change the second time.
UPDATE sendonce.list_members m
   SET status = 'unsubscribed', unsubscribed_at = now(), updated_at = now()
  FROM sendonce.campaign_lists cl
 WHERE cl.account_id = %(account_id)s AND cl.campaign_id = %(campaign_id)s
   AND m.account_id = cl.account_id AND m.list_id = cl.list_id AND m.subscriber_id = %(subscriber_id)s
   AND m.status = 'confirmed'
RETURNING m.list_id;

-- resubscribe_campaign_lists --
-- Undo a recent unsubscribe from those lists (the person asked for it on the unsubscribe page). Only a
-- recent one: the link never expires and travels with every forwarded copy of the mail, so an older
-- unsubscribe is undone only through a confirmation mail to the address (rejoin_campaign_lists).
UPDATE sendonce.list_members m
   SET status = 'confirmed', updated_at = now()
  FROM sendonce.campaign_lists cl
 WHERE cl.account_id = %(account_id)s AND cl.campaign_id = %(campaign_id)s
   AND m.account_id = cl.account_id AND m.list_id = cl.list_id AND m.subscriber_id = %(subscriber_id)s
   AND m.status = 'unsubscribed'
   AND m.unsubscribed_at > now() - make_interval(secs => %(within_seconds)s)
RETURNING m.list_id;

-- rejoin_campaign_lists --
-- Ask to rejoin lists left longer ago than the undo allows: each such membership becomes pending, in
-- its next double opt-in round, and the caller queues that round's confirmation mail in the same
-- transaction. Only the address's owner can confirm it; a forwarded copy of an old mail can make a
-- confirmation mail, never a subscription. Again: nothing left to change (pending, not unsubscribed).
UPDATE sendonce.list_members m
   SET status = 'pending', optin_round = m.optin_round + 1, round_started_at = now(), updated_at = now()
  FROM sendonce.campaign_lists cl
 WHERE cl.account_id = %(account_id)s AND cl.campaign_id = %(campaign_id)s
   AND m.account_id = cl.account_id AND m.list_id = cl.list_id AND m.subscriber_id = %(subscriber_id)s
   AND m.status = 'unsubscribed'
   AND m.unsubscribed_at <= now() - make_interval(secs => %(within_seconds)s)
RETURNING m.list_id, m.subscriber_id, m.optin_round;

-- subscription_state --
-- What the unsubscribe page shows: the account, the campaign's lists and this subscriber's membership
-- (and whether an unsubscribe is recent enough to be undone from the page).
SELECT a.name AS account_name, l.list_id, l.name AS list_name, m.status,
       m.status = 'unsubscribed' AND m.unsubscribed_at > now() - make_interval(secs => %(within_seconds)s) AS undoable
  FROM sendonce.campaign_lists cl
  JOIN sendonce.lists l ON l.account_id = cl.account_id AND l.list_id = cl.list_id
  JOIN sendonce.accounts a ON a.account_id = cl.account_id
  LEFT JOIN sendonce.list_members m
    ON m.account_id = cl.account_id AND m.list_id = cl.list_id AND m.subscriber_id = %(subscriber_id)s
 WHERE cl.account_id = %(account_id)s AND cl.campaign_id = %(campaign_id)s
 ORDER BY l.list_id;

-- find_delivery_by_job_id --
-- The delivery a provider event names by our job id (unique across accounts by construction): a
-- campaign job id (campaign:<campaign_id>:<subscriber_id>) through its campaign's account and the
-- tenant-first unique index, any other through the transactional index.
SELECT d.account_id, d.delivery_id, d.campaign_id, d.email, d.email_key
  FROM sendonce.campaigns c
  JOIN sendonce.deliveries d ON d.account_id = c.account_id AND d.job_id = %(job_id)s
 WHERE c.campaign_id = %(campaign_id)s::bigint
UNION ALL
SELECT account_id, delivery_id, campaign_id, email, email_key
  FROM sendonce.deliveries
 WHERE %(campaign_id)s::bigint IS NULL AND job_id = %(job_id)s AND campaign_id IS NULL
 LIMIT 2;

-- find_delivery_by_message_id --
-- The delivery a provider event names by the provider's own message id.
SELECT account_id, delivery_id, campaign_id, email, email_key
  FROM sendonce.deliveries
 WHERE transport_message_id = %(message_id)s
   AND transport_message_id !~ '^[0-9]{3}[ -]'  -- (the index's predicate: SMTP replies are not ids)
 LIMIT 2;

-- insert_feedback_event --
-- Record a provider event once: a row back means it is new and its effects must be applied.
INSERT INTO sendonce.feedback_events
       (account_id, provider, event_id, kind, email, email_key, job_id, delivery_id, occurred_at, detail)
VALUES (%(account_id)s, %(provider)s, %(event_id)s, %(kind)s, %(email)s, %(email_key)s, %(job_id)s,
        %(delivery_id)s, %(occurred_at)s, %(detail)s)
ON CONFLICT (account_id, provider, event_id) DO NOTHING
RETURNING received_at;

-- set_delivery_feedback --
-- What the recipient's side said about a delivery; a complaint outranks a bounce, a hard bounce a soft one.
UPDATE sendonce.deliveries
   SET feedback = CASE
           WHEN feedback = 'complaint' OR %(kind)s = 'complaint' THEN 'complaint'
           WHEN feedback = 'hard_bounce' OR %(kind)s = 'hard_bounce' THEN 'hard_bounce'
           ELSE 'soft_bounce' END,
       feedback_at = now()
 WHERE account_id = %(account_id)s AND delivery_id = %(delivery_id)s;

-- lock_soft_bounces --
-- Held to the end of the transaction, taken before count_soft_bounces (a statement of its own, so
-- that the count's snapshot is taken after the wait): two requests reporting soft bounces of one
-- address at once each counted their own and the committed ones, never each other's, and the limit
-- was passed with nobody suppressed.
SELECT pg_advisory_xact_lock(hashtextextended('sendonce.soft_bounces:' || %(account_id)s::text || ':' || %(email_key)s, 0));

-- count_soft_bounces --
-- Soft bounces of an address within a period (after lock_soft_bounces).
SELECT count(*) AS n
  FROM sendonce.feedback_events
 WHERE account_id = %(account_id)s AND email_key = %(email_key)s AND kind = 'soft_bounce'
   AND received_at > now() - %(period)s::interval;

-- set_subscriber_status_for_feedback --
-- A bounced address is 'bounced', a complaining one 'unsubscribed'; an earlier such status stays.
UPDATE sendonce.subscribers
   SET status = %(status)s, updated_at = now()
 WHERE account_id = %(account_id)s AND email_key = %(email_key)s AND status IN ('pending', 'confirmed');

-- campaign_feedback --
-- A sending campaign's bounce and complaint counts against what it attempted, with its limits.
SELECT c.status,
       coalesce(c.max_bounce_rate, %(default_bounce_rate)s) AS max_bounce_rate,
       coalesce(c.max_complaint_rate, %(default_complaint_rate)s) AS max_complaint_rate,
       (SELECT count(*) FROM sendonce.deliveries d
         WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
           AND d.status IN ('sent', 'failed')) AS attempted,
       (SELECT count(*) FROM sendonce.deliveries d
         WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
           AND d.feedback = 'hard_bounce') AS bounces,
       (SELECT count(*) FROM sendonce.deliveries d
         WHERE d.account_id = c.account_id AND d.campaign_id = c.campaign_id
           AND d.feedback = 'complaint') AS complaints
  FROM sendonce.campaigns c
 WHERE c.account_id = %(account_id)s AND c.campaign_id = %(campaign_id)s
   -- only a sending campaign can be paused: a finished one's rows are not counted (a provider's
   -- replays of old events check it again, and its counts read every row of the campaign)
   AND c.status = 'sending';

-- pause_campaign_with_reason --
-- CAS sending -> paused by a worker, saying why: its bounce or complaint rate passed its limit, the
-- transport refuses its sender.
UPDATE sendonce.campaigns
   SET status = 'paused', paused_reason = %(reason)s, updated_at = now()
 WHERE account_id = %(account_id)s AND campaign_id = %(campaign_id)s AND status = 'sending'
RETURNING campaign_id;

-- take_tokens_partial --
-- Up to %(want)s tokens from a shared bucket (see sendonce.take_tokens): granted, and what is left.
SELECT granted, remaining
  FROM sendonce.take_tokens(%(account_id)s, %(bucket)s, %(capacity)s, %(rate)s, %(want)s, true);

-- refund_tokens --
-- Give back tokens taken for rows that were not there to claim.
UPDATE sendonce.rate_buckets
   SET tokens = least(%(capacity)s::float8, tokens + %(amount)s)
 WHERE account_id = %(account_id)s AND bucket = %(bucket)s;

-- defer_claims --
-- Rows claimed but over a rate limit: back to the queue until their turn, fenced. A deferral is not a
-- failure and not a doubt: failures and uncertain are left as they are.
UPDATE sendonce.deliveries d
   SET status = 'queued', lease_expires_at = NULL, not_before = now() + make_interval(secs => u.delay),
       updated_at = now()
  FROM unnest(%(account_ids)s::bigint[], %(delivery_ids)s::bigint[], %(attempts)s::int[], %(delays)s::float8[])
       AS u(account_id, delivery_id, attempt, delay)
 WHERE d.account_id = u.account_id AND d.delivery_id = u.delivery_id AND d.attempt = u.attempt
   AND d.status = 'sending'
RETURNING d.delivery_id;

-- import_suppressions --
-- Suppress many addresses at once; those suppressed already keep their first reason.
INSERT INTO sendonce.suppressions (account_id, email_key, email, reason)
SELECT %(account_id)s, u.email_key, u.email, u.reason
  FROM unnest(%(email_keys)s::text[], %(emails)s::text[], %(reasons)s::sendonce.suppression_reason[])
       AS u(email_key, email, reason)
ON CONFLICT (account_id, email_key) DO NOTHING
RETURNING email_key;

-- export_suppressions --
-- One page of an account's suppressions, in email_key order, after the given key (the primary key's
-- order: each page is an index range, however many there are).
SELECT email, email_key, reason, created_at
  FROM sendonce.suppressions
 WHERE account_id = %(account_id)s
   AND email_key > %(after)s
 ORDER BY email_key
 LIMIT %(limit)s;

-- create_template --
-- A stored template.
INSERT INTO sendonce.templates (account_id, name, subject, text_body, html_body)
VALUES (%(account_id)s, %(name)s, %(subject)s, %(text_body)s, %(html_body)s)
RETURNING template_id, created_at, updated_at;

-- get_template --
-- One stored template.
SELECT template_id, name, subject, text_body, html_body, created_at, updated_at
  FROM sendonce.templates
 WHERE account_id = %(account_id)s AND template_id = %(template_id)s;

-- update_template --
-- Replace a stored template's content (campaigns keep the copy they were created with).
UPDATE sendonce.templates
   SET name = %(name)s, subject = %(subject)s, text_body = %(text_body)s, html_body = %(html_body)s,
       updated_at = now()
 WHERE account_id = %(account_id)s AND template_id = %(template_id)s
RETURNING template_id, created_at, updated_at;

-- get_subscriber --
-- One subscriber, for a template preview.
SELECT subscriber_id, email, name, attributes
  FROM sendonce.subscribers
 WHERE account_id = %(account_id)s
   AND (subscriber_id = %(subscriber_id)s::bigint OR email_key = %(email_key)s::text);

-- recipients_missing_attributes --
-- Recipients a campaign would reach that lack one of the attributes its templates use (with no
-- attributes given: any recipients, a sample).
SELECT s.subscriber_id, s.email, s.name, s.attributes
  FROM sendonce.subscribers s
 WHERE s.account_id = %(account_id)s AND s.status = 'confirmed'
   AND (cardinality(%(keys)s::text[]) = 0 OR NOT (s.attributes ?& %(keys)s::text[]))
   AND EXISTS (SELECT 1
                 FROM sendonce.list_members m
                 JOIN sendonce.campaign_lists cl ON cl.account_id = m.account_id AND cl.list_id = m.list_id
                WHERE m.account_id = s.account_id AND m.subscriber_id = s.subscriber_id
                  AND m.status = 'confirmed' AND cl.campaign_id = %(campaign_id)s)
   AND NOT EXISTS (SELECT 1 FROM sendonce.suppressions x
                    WHERE x.account_id = s.account_id AND x.email_key = s.email_key)
 LIMIT %(limit)s;
