-- 0001: accounts, subscribers, lists, campaigns, suppressions, and the one outbox (deliveries).
--
-- Multi-tenant from the first table: every table carries account_id and every primary key and
-- unique constraint starts with it, so the schema can be distributed by account (Citus) later.
-- Everything lives in the schema "sendonce", so an application that shares the database (and
-- enqueues mail inside its own transactions) keeps its own table names.

CREATE SCHEMA IF NOT EXISTS sendonce;

CREATE TYPE sendonce.campaign_status AS ENUM ('draft', 'approved', 'sending', 'paused', 'sent', 'cancelled');
CREATE TYPE sendonce.delivery_status AS ENUM ('queued', 'sending', 'sent', 'suppressed', 'failed');
CREATE TYPE sendonce.subscriber_status AS ENUM ('pending', 'confirmed', 'unsubscribed', 'bounced');
CREATE TYPE sendonce.membership_status AS ENUM ('pending', 'confirmed', 'unsubscribed');
CREATE TYPE sendonce.suppression_reason AS ENUM ('manual', 'bounce', 'complaint', 'unsubscribe');

CREATE TABLE sendonce.accounts (
    account_id   bigint GENERATED ALWAYS AS IDENTITY,
    name         text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- SHA-256 of the API key. The key is random (256 bits), so a fast hash is enough; the key
    -- itself is shown once, at creation, and never stored.
    api_key_hash bytea NOT NULL,
    from_email   text NOT NULL,
    from_name    text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id)
);

CREATE TABLE sendonce.subscribers (
    account_id    bigint NOT NULL REFERENCES sendonce.accounts,
    subscriber_id bigint GENERATED ALWAYS AS IDENTITY,
    email         text NOT NULL,           -- as given
    email_key     text NOT NULL,           -- see sendonce.domain.addresses
    name          text,
    attributes    jsonb NOT NULL DEFAULT '{}',
    status        sendonce.subscriber_status NOT NULL DEFAULT 'confirmed',
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, subscriber_id),
    -- One subscriber per address and account: an upsert by address can never create a second row.
    UNIQUE (account_id, email_key)
);

CREATE TABLE sendonce.lists (
    account_id bigint NOT NULL REFERENCES sendonce.accounts,
    list_id    bigint GENERATED ALWAYS AS IDENTITY,
    name       text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, list_id)
);

CREATE TABLE sendonce.list_members (
    account_id    bigint NOT NULL,
    list_id       bigint NOT NULL,
    subscriber_id bigint NOT NULL,
    status        sendonce.membership_status NOT NULL DEFAULT 'confirmed',
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, list_id, subscriber_id),
    FOREIGN KEY (account_id, list_id) REFERENCES sendonce.lists,
    FOREIGN KEY (account_id, subscriber_id) REFERENCES sendonce.subscribers
);
CREATE INDEX list_members_by_subscriber ON sendonce.list_members (account_id, subscriber_id);

CREATE TABLE sendonce.campaigns (
    account_id    bigint NOT NULL REFERENCES sendonce.accounts,
    campaign_id   bigint GENERATED ALWAYS AS IDENTITY,
    name          text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    subject       text NOT NULL,
    text_body     text NOT NULL,
    html_body     text,
    from_email    text NOT NULL,
    from_name     text,
    status        sendonce.campaign_status NOT NULL DEFAULT 'draft',
    scheduled_for timestamptz,
    started_at    timestamptz,
    finished_at   timestamptz,
    -- The recipient list is built in chunks by subscriber_id; build_cursor is the last
    -- subscriber_id a committed chunk examined, so a crashed build resumes where it stopped.
    build_cursor  bigint NOT NULL DEFAULT 0,
    built_at      timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, campaign_id),
    CHECK (status IN ('draft', 'cancelled') OR scheduled_for IS NOT NULL)
);
-- The scheduler looks only at campaigns that may need work.
CREATE INDEX campaigns_active ON sendonce.campaigns (status, scheduled_for)
    WHERE status IN ('approved', 'sending');

CREATE TABLE sendonce.campaign_lists (
    account_id  bigint NOT NULL,
    campaign_id bigint NOT NULL,
    list_id     bigint NOT NULL,
    PRIMARY KEY (account_id, campaign_id, list_id),
    FOREIGN KEY (account_id, campaign_id) REFERENCES sendonce.campaigns,
    FOREIGN KEY (account_id, list_id) REFERENCES sendonce.lists
);

CREATE TABLE sendonce.suppressions (
    account_id bigint NOT NULL REFERENCES sendonce.accounts,
    email_key  text NOT NULL,
    email      text NOT NULL,
    reason     sendonce.suppression_reason NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, email_key)
);

-- The outbox: one row per intended message, campaign or transactional. Every kind of mail goes
-- through the same claim (status queued -> sending, with a lease and a fencing token), the same
-- send and the same fenced record (sending -> sent / failed). Rows are never deleted by sending.
CREATE TABLE sendonce.deliveries (
    account_id           bigint NOT NULL REFERENCES sendonce.accounts,
    delivery_id          bigint GENERATED ALWAYS AS IDENTITY,
    -- Deterministic identity of the intended message (campaign:<campaign_id>:<subscriber_id>, ...):
    -- the transport's idempotency key, the Sendonce-Job-Id header and the Message-ID.
    job_id               text NOT NULL,
    kind                 text NOT NULL,
    -- Lower is sooner: transactional mail is claimed before any campaign row.
    priority             smallint NOT NULL DEFAULT 100,
    campaign_id          bigint,
    subscriber_id        bigint,
    email                text NOT NULL,
    email_key            text NOT NULL,
    payload              jsonb NOT NULL DEFAULT '{}',
    status               sendonce.delivery_status NOT NULL DEFAULT 'queued',
    not_before           timestamptz NOT NULL DEFAULT now(),
    -- Fencing token: incremented by every claim and never decremented. A worker records an outcome
    -- only WHERE attempt = the value it claimed, so a worker presumed dead cannot complete a row
    -- that someone else re-claimed.
    attempt              integer NOT NULL DEFAULT 0,
    failures             integer NOT NULL DEFAULT 0,
    lease_expires_at     timestamptz,
    claimed_by           text,
    -- The last attempt may have reached the recipient (its lease expired, or the transport failed
    -- in a way that does not say whether it accepted). A re-send through a transport without
    -- idempotency keys is written to the possible_duplicates ledger.
    uncertain            boolean NOT NULL DEFAULT false,
    sent_at              timestamptz,
    transport_message_id text,
    last_error           text,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, delivery_id),
    UNIQUE (account_id, job_id),
    FOREIGN KEY (account_id, campaign_id) REFERENCES sendonce.campaigns,
    CHECK ((kind = 'campaign') = (campaign_id IS NOT NULL)),
    CHECK (status <> 'sending' OR lease_expires_at IS NOT NULL)
);
-- One message per address per campaign, whatever happens upstream (two subscriber rows that
-- normalize to one address, a rebuild after a crash). The cheapest layer, and the last one.
CREATE UNIQUE INDEX deliveries_one_per_address ON sendonce.deliveries (account_id, campaign_id, email_key)
    WHERE campaign_id IS NOT NULL;
-- The claim walks these two partial indexes: they hold only queued rows, so they stay small
-- however many rows have been sent.
CREATE INDEX deliveries_campaign_queue ON sendonce.deliveries (account_id, campaign_id, not_before, delivery_id)
    WHERE status = 'queued' AND campaign_id IS NOT NULL;
CREATE INDEX deliveries_transactional_queue ON sendonce.deliveries (priority, not_before, delivery_id)
    WHERE status = 'queued' AND campaign_id IS NULL;
-- Expired leases are found through this one.
CREATE INDEX deliveries_leases ON sendonce.deliveries (lease_expires_at) WHERE status = 'sending';

-- Every re-send of an attempt that may already have reached the recipient, through a transport
-- that cannot deduplicate. A recorded duplicate is a counted cost; a silent one is a bug.
CREATE TABLE sendonce.possible_duplicates (
    account_id  bigint NOT NULL,
    delivery_id bigint NOT NULL,
    attempt     integer NOT NULL,
    job_id      text NOT NULL,
    campaign_id bigint,
    reason      text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, delivery_id, attempt),
    FOREIGN KEY (account_id, delivery_id) REFERENCES sendonce.deliveries
);
CREATE INDEX possible_duplicates_by_campaign ON sendonce.possible_duplicates (account_id, campaign_id);

-- New outbox rows wake idle workers at once (LISTEN sendonce_work). Once per statement, and only
-- on insert: the hot path (claims, records) never notifies.
CREATE FUNCTION sendonce.notify_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sendonce_work', TG_TABLE_NAME);
    RETURN NULL;
END
$$;
CREATE TRIGGER deliveries_wake_workers AFTER INSERT ON sendonce.deliveries
    FOR EACH STATEMENT EXECUTE FUNCTION sendonce.notify_work();
