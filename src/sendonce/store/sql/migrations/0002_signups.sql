-- 0002: signup verification through the outbox, client idempotency keys, rate buckets, alerts.

ALTER TABLE sendonce.accounts
    ADD COLUMN signup_window interval,          -- NULL: the server default (SENDONCE_SIGNUP_WINDOW)
    ADD COLUMN signup_list_id bigint;           -- verified signups become confirmed members of it
ALTER TABLE sendonce.accounts
    ADD CONSTRAINT accounts_signup_list_fk FOREIGN KEY (account_id, signup_list_id) REFERENCES sendonce.lists;

-- The pending (then verified) user of a product's signup flow: one per address and origin.
CREATE TABLE sendonce.signups (
    account_id   bigint NOT NULL REFERENCES sendonce.accounts,
    signup_id    bigint GENERATED ALWAYS AS IDENTITY,
    email        text NOT NULL,
    email_key    text NOT NULL,
    origin       text NOT NULL CHECK (origin IN ('web', 'app', 'api')),
    name         text,
    locale       text,
    redirect_url text,
    status       text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'verified')),
    verified_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, signup_id),
    UNIQUE (account_id, email_key, origin)
);

-- The idempotency window of one operation (operation_key = HMAC of account, event, address, origin).
-- The window runs from the first accepted request; the row is locked by every request for the same
-- operation, so concurrent requests are serialized here and only one of them can open a window.
-- generation counts the windows: the outbox row of window n has operation_key '<key>:<n>'.
CREATE TABLE sendonce.signup_windows (
    account_id    bigint NOT NULL REFERENCES sendonce.accounts,
    operation_key text NOT NULL,
    window_id     bigint GENERATED ALWAYS AS IDENTITY,
    generation    integer NOT NULL DEFAULT 1,
    opened_at     timestamptz NOT NULL DEFAULT now(),
    signup_id     bigint NOT NULL,
    answer        jsonb,                       -- the body the first request of the window got
    PRIMARY KEY (account_id, operation_key),
    FOREIGN KEY (account_id, signup_id) REFERENCES sendonce.signups
);

-- Outbox rows of transactional operations carry their operation key; one row per key and window.
ALTER TABLE sendonce.deliveries ADD COLUMN operation_key text;
CREATE UNIQUE INDEX deliveries_operation_key ON sendonce.deliveries (account_id, operation_key)
    WHERE operation_key IS NOT NULL;
-- GET /v1/outbox pages through an account's events by id.
CREATE INDEX deliveries_by_kind ON sendonce.deliveries (account_id, kind, delivery_id);

-- Client Idempotency-Key (IETF httpapi draft, Stripe): the stored answer of a request, written in the
-- same transaction as the request's own writes. account_id 0 is the admin scope (account creation).
CREATE TABLE sendonce.idempotency_keys (
    account_id      bigint NOT NULL,
    idempotency_key text NOT NULL,
    request_hash    text NOT NULL,
    method          text NOT NULL,
    path            text NOT NULL,
    response_status integer NOT NULL,
    response_body   text NOT NULL,             -- exactly the bytes of the first answer
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (account_id, idempotency_key)
);
CREATE INDEX idempotency_keys_expiry ON sendonce.idempotency_keys (expires_at);

-- Token buckets that hold across processes and hosts and survive restarts.
CREATE TABLE sendonce.rate_buckets (
    account_id bigint NOT NULL,
    bucket     text NOT NULL,
    tokens     double precision NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account_id, bucket)
);

-- Flags raised by the abuse detector (and, later, by campaign bounce thresholds). One per subject,
-- kind and episode, whatever the number of API processes that noticed it.
CREATE TABLE sendonce.alerts (
    account_id bigint NOT NULL,
    alert_id   bigint GENERATED ALWAYS AS IDENTITY,
    kind       text NOT NULL,
    subject    text NOT NULL,
    episode    text NOT NULL,
    detail     jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, alert_id),
    UNIQUE (account_id, kind, subject, episode)
);
