DROP FUNCTION buzz.refresh_statistics();
ALTER TABLE buzz.members RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
ALTER TABLE buzz.events RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
ALTER TABLE buzz.events
  ALTER COLUMN id SET STATISTICS -1, ALTER COLUMN content SET STATISTICS -1, ALTER COLUMN sig SET STATISTICS -1,
  ALTER COLUMN tags SET STATISTICS -1, ALTER COLUMN received_at SET STATISTICS -1, ALTER COLUMN tagvals SET STATISTICS -1;
ALTER TABLE buzz.event_tags RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
REVOKE ALL ON buzz.retention, buzz.upkeep_log FROM buzz_relay, buzz_operator;
DROP FUNCTION IF EXISTS buzz.upkeep_status();
DROP FUNCTION IF EXISTS buzz.upkeep_finish(text, bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_purge(text, integer);
DROP FUNCTION IF EXISTS buzz.upkeep_candidates(text, bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_retention_waiting(text);
DROP FUNCTION IF EXISTS buzz.upkeep_retention_candidates(text, bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_retention_scope(buzz.retention);
DROP FUNCTION IF EXISTS buzz.upkeep_reminder_candidates(bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_expired_candidates(bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_keeps(text, integer, text, bigint);
DROP FUNCTION IF EXISTS buzz.upkeep_guarded_kinds();
DROP FUNCTION IF EXISTS buzz.upkeep_setting(text);
DROP FUNCTION IF EXISTS buzz.upkeep_try_lock();
DROP FUNCTION IF EXISTS buzz.upkeep_require_lock();
DROP FUNCTION IF EXISTS buzz.upkeep_holds_lock();
DROP FUNCTION IF EXISTS buzz.upkeep_lock_key();
DROP INDEX IF EXISTS buzz.reminders_settled_idx;
DROP TABLE IF EXISTS buzz.upkeep_log;
DROP TABLE IF EXISTS buzz.retention;
DELETE FROM buzz.config WHERE key IN ('upkeep_grace_seconds', 'upkeep_reminder_keep_seconds');
