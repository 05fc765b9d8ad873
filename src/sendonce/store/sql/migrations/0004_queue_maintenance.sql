-- 0004: keep the outbox's queue indexes lean.
--
-- Every claim moves rows out of the partial queue indexes; their old index entries stay until a
-- vacuum removes them, and each claim walks past them from the front of the queue. With the default
-- (vacuum once 20 % of the table changed), a million-row campaign makes claims wade through up to
-- 200,000 dead entries. Vacuum the outbox after 1 % instead, without throttling.
ALTER TABLE sendonce.deliveries SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
