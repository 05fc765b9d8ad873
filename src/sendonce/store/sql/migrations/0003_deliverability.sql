-- 0003: deliverability and compliance: opt-in lists, templates, DKIM settings, bounce and complaint
-- feedback, campaign bounce thresholds, rate limits enforced in PostgreSQL.

ALTER TABLE sendonce.lists
    ADD COLUMN opt_in text NOT NULL DEFAULT 'single' CHECK (opt_in IN ('single', 'double'));

ALTER TABLE sendonce.accounts
    ADD COLUMN dkim_domain text,
    ADD COLUMN dkim_selector text,
    -- where the private key is: a file path or the name of an environment variable of the worker;
    -- the key itself is never stored in the database
    ADD COLUMN dkim_key_file text,
    ADD COLUMN dkim_key_env text,
    ADD CONSTRAINT accounts_dkim_complete CHECK (
        (dkim_domain IS NULL AND dkim_selector IS NULL AND dkim_key_file IS NULL AND dkim_key_env IS NULL)
        OR (dkim_domain IS NOT NULL AND dkim_selector IS NOT NULL
            AND (dkim_key_file IS NOT NULL) <> (dkim_key_env IS NOT NULL)));

CREATE TABLE sendonce.templates (
    account_id  bigint NOT NULL REFERENCES sendonce.accounts,
    template_id bigint GENERATED ALWAYS AS IDENTITY,
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    subject     text NOT NULL,
    text_body   text,
    html_body   text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, template_id),
    CHECK (text_body IS NOT NULL OR html_body IS NOT NULL)
);

ALTER TABLE sendonce.campaigns
    ADD COLUMN template_id bigint,
    -- pause the campaign when its bounce or complaint rate passes these (NULL: the server default)
    ADD COLUMN max_bounce_rate double precision CHECK (max_bounce_rate BETWEEN 0 AND 1),
    ADD COLUMN max_complaint_rate double precision CHECK (max_complaint_rate BETWEEN 0 AND 1),
    ADD COLUMN paused_reason text,
    ADD CONSTRAINT campaigns_template_fk FOREIGN KEY (account_id, template_id) REFERENCES sendonce.templates;

-- What the recipient's side said about a delivery: a bounce (at the SMTP conversation or reported
-- later by the provider) or a complaint.
ALTER TABLE sendonce.deliveries
    ADD COLUMN feedback text CHECK (feedback IN ('hard_bounce', 'soft_bounce', 'complaint')),
    ADD COLUMN feedback_at timestamptz;
-- Webhooks find their delivery by job id (job ids are unique across accounts by construction: they
-- embed a global id) or by the provider's message id. Plain indexes: uniqueness stays tenant-first.
CREATE INDEX deliveries_by_job_id ON sendonce.deliveries (job_id);
CREATE INDEX deliveries_by_transport_message_id ON sendonce.deliveries (transport_message_id)
    WHERE transport_message_id IS NOT NULL;
-- Campaign feedback rates.
CREATE INDEX deliveries_campaign_feedback ON sendonce.deliveries (account_id, campaign_id, feedback)
    WHERE feedback IS NOT NULL;

-- Every provider event, once: ingestion is idempotent on (provider, provider's event id).
CREATE TABLE sendonce.feedback_events (
    account_id  bigint NOT NULL REFERENCES sendonce.accounts,
    provider    text NOT NULL,
    event_id    text NOT NULL,
    kind        text NOT NULL,
    email       text,
    email_key   text,
    job_id      text,
    delivery_id bigint,
    occurred_at timestamptz,
    received_at timestamptz NOT NULL DEFAULT now(),
    detail      jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (account_id, provider, event_id)
);
CREATE INDEX feedback_events_soft_bounces ON sendonce.feedback_events (account_id, email_key, received_at)
    WHERE kind = 'soft_bounce';

-- A token bucket, taken in one statement: up to p_want tokens (or all or nothing), refilled at
-- p_rate per second up to p_capacity. Returns what was granted and the fraction of a token left,
-- so the caller can schedule what it could not send. The row lock makes it hold across processes.
CREATE FUNCTION sendonce.take_tokens(p_account bigint, p_bucket text, p_capacity float8, p_rate float8,
                                     p_want float8, p_partial boolean)
RETURNS TABLE (granted float8, remaining float8) LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_tokens float8;
BEGIN
    INSERT INTO sendonce.rate_buckets (account_id, bucket, tokens, updated_at)
    VALUES (p_account, p_bucket, p_capacity, v_now)
    ON CONFLICT (account_id, bucket) DO NOTHING;
    SELECT least(p_capacity, b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * p_rate)
      INTO v_tokens
      FROM sendonce.rate_buckets b
     WHERE b.account_id = p_account AND b.bucket = p_bucket
       FOR UPDATE;
    IF p_partial THEN
        granted := greatest(0, least(p_want, floor(v_tokens)));
    ELSIF v_tokens >= p_want THEN
        granted := p_want;
    ELSE
        granted := 0;
    END IF;
    remaining := v_tokens - granted;
    UPDATE sendonce.rate_buckets SET tokens = remaining, updated_at = v_now
     WHERE account_id = p_account AND bucket = p_bucket;
    RETURN NEXT;
END
$$;
