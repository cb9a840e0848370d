-- Back to 0028's grants: both roles with DML on every table, functions with the caller's rights
-- and search_path, pg_logical_emit_message executable by PUBLIC.

DO $$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
            WHERE p.pronamespace = 'buzz'::regnamespace AND p.prokind = 'f' LOOP
    EXECUTE format('ALTER FUNCTION %s RESET search_path', f);
  END LOOP;
END $$;

DO $$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
            WHERE p.proname = 'pg_logical_emit_message'
              AND p.pronamespace = 'pg_catalog'::regnamespace
              AND pg_catalog.pg_has_role(p.proowner, 'USAGE') LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM buzz_relay', f);
  END LOOP;
END $$;

ALTER FUNCTION buzz.accept_event(jsonb) SECURITY INVOKER;
ALTER FUNCTION buzz.accept_events(jsonb, integer) SECURITY INVOKER;
ALTER FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb) SECURITY INVOKER;
ALTER FUNCTION buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]) SECURITY INVOKER;
ALTER FUNCTION buzz.claim_visibility_work(uuid, integer, interval) SECURITY INVOKER;
ALTER FUNCTION buzz.release_visibility_claim(text, uuid, text, interval, interval) SECURITY INVOKER;
ALTER FUNCTION buzz.release_visibility_claims(uuid[]) SECURITY INVOKER;
ALTER FUNCTION buzz.sweep_visibility() SECURITY INVOKER;
ALTER FUNCTION buzz.claim_due_reminders(integer, interval, boolean) SECURITY INVOKER;
ALTER FUNCTION buzz.confirm_reminder_claims(text[], bigint[]) SECURITY INVOKER;
ALTER FUNCTION buzz.rollback_reminder_claims(text[], bigint[]) SECURITY INVOKER;
ALTER FUNCTION buzz.hide_dm(text, uuid) SECURITY INVOKER;
ALTER FUNCTION buzz.unhide_dm(text, uuid) SECURITY INVOKER;

DROP FUNCTION buzz.retry_visibility(text);
DROP FUNCTION buzz.reset_visibility(text);
DROP VIEW buzz.buzz_schema_migrations;

REVOKE ALL ON ALL TABLES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA buzz FROM buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz REVOKE SELECT ON TABLES FROM buzz_operator;

-- 0012.
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA buzz TO buzz_relay, buzz_operator;
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA buzz TO buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO buzz_relay, buzz_operator;
REVOKE DELETE ON buzz.visibility_retired FROM buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO buzz_relay, buzz_operator;

-- Functions as 0002, 0003, 0004 and 0028 granted them.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA buzz TO PUBLIC;
REVOKE ALL ON FUNCTION buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.publish_visibility_snapshot(text, bigint, jsonb),
  buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
  buzz.claim_visibility_work(uuid, integer, interval),
  buzz.release_visibility_claim(text, uuid, text, interval, interval),
  buzz.release_visibility_claims(uuid[]), buzz.sweep_visibility(),
  buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.rollback_reminder_claim(text, bigint, bigint), buzz.claim_due_reminders(integer, interval, boolean),
  buzz.confirm_reminder_claim(text, bigint, bigint), buzz.confirm_reminder_claims(text[], bigint[]),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.reminder_status(), buzz.next_reminder_wakeup()
  FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.hide_dm(text, uuid), buzz.unhide_dm(text, uuid),
  buzz.publish_visibility_snapshot(text, bigint, jsonb),
  buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
  buzz.claim_visibility_work(uuid, integer, interval),
  buzz.release_visibility_claim(text, uuid, text, interval, interval),
  buzz.release_visibility_claims(uuid[]), buzz.sweep_visibility(), buzz.visibility_lag(),
  buzz.visibility_source(text), buzz.visibility_lag_detail(integer),
  buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.rollback_reminder_claim(text, bigint, bigint), buzz.claim_due_reminders(integer, interval, boolean),
  buzz.confirm_reminder_claim(text, bigint, bigint), buzz.confirm_reminder_claims(text[], bigint[]),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.reminder_status(), buzz.next_reminder_wakeup()
  TO buzz_relay, buzz_operator;
