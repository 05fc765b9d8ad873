-- 0005: fewer index entries per claim and per record.
--
-- A claim and a record each write a new version of the row, and every index of the table gets an
-- entry for it. Three indexes served lookups that campaign rows (almost all rows) do not need:
-- * listing an account's events by kind: campaign rows are listed by campaign, so only
--   transactional rows need it;
-- * finding a row by job id alone (webhooks): a campaign job id names its campaign, whose account
--   leads to the tenant-first unique (account_id, job_id); only transactional rows need it;
-- * finding a row by the provider's message id (webhooks): SMTP "message ids" are the server's
--   reply ("250 2.0.0 Ok: queued as ..."), never looked up; only HTTP providers' ids are.
DROP INDEX sendonce.deliveries_by_kind;
CREATE INDEX deliveries_transactional_by_kind ON sendonce.deliveries (account_id, kind, delivery_id)
    WHERE campaign_id IS NULL;
DROP INDEX sendonce.deliveries_by_job_id;
CREATE INDEX deliveries_transactional_by_job_id ON sendonce.deliveries (job_id)
    WHERE campaign_id IS NULL;
DROP INDEX sendonce.deliveries_by_transport_message_id;
CREATE INDEX deliveries_by_provider_message_id ON sendonce.deliveries (transport_message_id)
    WHERE transport_message_id IS NOT NULL AND transport_message_id !~ '^[0-9]{3}[ -]';
-- campaign job ids lead to their account through the campaign
CREATE INDEX campaigns_by_id ON sendonce.campaigns (campaign_id);
