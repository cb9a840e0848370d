-- Reverses 0003_visibility: the NIP-DV publisher and outbox functions (the tables belong to 0001).
DROP FUNCTION IF EXISTS buzz.visibility_lag_detail(integer);
DROP FUNCTION IF EXISTS buzz.visibility_lag();
DROP FUNCTION IF EXISTS buzz.sweep_visibility();
DROP FUNCTION IF EXISTS buzz.release_visibility_claims(uuid[]);
DROP FUNCTION IF EXISTS buzz.release_visibility_claim(text, uuid, text, interval, interval);
DROP FUNCTION IF EXISTS buzz.claim_visibility_work(uuid, integer, interval);
DROP FUNCTION IF EXISTS buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]);
DROP FUNCTION IF EXISTS buzz.publish_visibility_snapshot(text, bigint, jsonb);
DROP FUNCTION IF EXISTS buzz.visibility_source(text);
