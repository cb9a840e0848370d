-- Three roles. The schema owner runs migrations and is trusted with everything. buzz_relay is
-- what `buzzpg serve` and `buzzpg send` need: the entry points below, the reads of REQ, COUNT and
-- the listener, its own settings and instance rows, and (outside these grants) REPLICATION.
-- buzz_operator reads everything and calls the operator functions; it cannot call a function that
-- trusts a signature check, and writes nothing by hand.
--
-- The entry points that write run as their owner (SECURITY DEFINER, in their definitions), so
-- neither role needs write rights on the tables they change. Every buzz function pins its
-- search_path, so objects created in schemas such as public are never resolved inside them.

-- Roles are shared by every database of the cluster: created once, never dropped here.
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'buzz_relay') THEN
    CREATE ROLE buzz_relay NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'buzz_operator') THEN
    CREATE ROLE buzz_operator NOLOGIN;
  END IF;
END $$;

-- golang-migrate keeps its version table in the migrating role's schema (usually public), which
-- is not on the relay's search_path (pg_catalog, buzz): the schema check reads it through this view.
CREATE VIEW buzz.buzz_schema_migrations AS SELECT version, dirty FROM buzz_schema_migrations;
COMMENT ON VIEW buzz.buzz_schema_migrations IS
  'golang-migrate''s version row (version, dirty), readable on the search_path pg_catalog, buzz.';
-- golang-migrate itself (serve's migration check) reads the table where it is.
GRANT SELECT ON buzz_schema_migrations TO buzz_relay, buzz_operator;

-- Nothing in schema buzz is granted except what follows.
REVOKE ALL ON ALL TABLES IN SCHEMA buzz FROM PUBLIC, buzz_relay, buzz_operator;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA buzz FROM PUBLIC, buzz_relay, buzz_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA buzz FROM PUBLIC, buzz_relay, buzz_operator;
-- Tables added later are readable by operators; functions added later must be granted by name
-- (PUBLIC may execute a new function, and both roles may use the schema).
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz GRANT SELECT ON TABLES TO buzz_operator;
GRANT USAGE ON SCHEMA buzz TO buzz_relay, buzz_operator;

-------------------------------------------------------------------------------------------------
-- buzz_relay.

-- Acceptance (serve and send), the snapshot publisher, the reminder scheduler.
GRANT EXECUTE ON FUNCTION
  buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.publish_visibility_snapshot(text, bigint, jsonb),
  buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
  buzz.claim_visibility_work(uuid, integer, interval),
  buzz.release_visibility_claim(text, uuid, text, interval, interval),
  buzz.release_visibility_claims(uuid[]), buzz.sweep_visibility(),
  buzz.claim_due_reminders(integer, interval, boolean, text[]),
  buzz.confirm_reminder_claims(text[], bigint[]), buzz.rollback_reminder_claims(text[], bigint[])
  TO buzz_relay;
-- Reads, and the instance bookkeeping (reap_instances runs with the caller's rights: dropping a
-- slot takes the caller's REPLICATION attribute).
GRANT EXECUTE ON FUNCTION
  buzz.visibility_source(text), buzz.visibility_lag(), buzz.next_reminder_wakeup(),
  buzz.instance_heartbeat(text, text, text), buzz.reap_instances(interval),
  buzz.cfg(text), buzz.now_unix(), buzz.is_hex64(text), buzz.reject(text, text)
  TO buzz_relay;
-- REQ and COUNT (events, their tag index, members), the listener's reads, the schema check.
GRANT SELECT ON buzz.events, buzz.event_tags, buzz.members, buzz.config, buzz.reminders, buzz.visibility_state,
  buzz.visibility_outbox, buzz.instances, buzz.buzz_schema_migrations TO buzz_relay;
-- serve writes its settings and its instance rows itself.
GRANT INSERT, UPDATE ON buzz.config TO buzz_relay;
GRANT INSERT, UPDATE, DELETE ON buzz.instances TO buzz_relay;
-- An undone claim waits for the claim's transaction with SELECT ... FOR SHARE, which needs UPDATE
-- on some column: a counter and a diagnostic nothing decides by.
GRANT UPDATE (rollbacks) ON buzz.reminders TO buzz_relay;
GRANT UPDATE (last_error) ON buzz.visibility_outbox TO buzz_relay;

-------------------------------------------------------------------------------------------------
-- buzz_operator.

GRANT SELECT ON ALL TABLES IN SCHEMA buzz TO buzz_operator;
GRANT SELECT ON ALL SEQUENCES IN SCHEMA buzz TO buzz_operator;
GRANT EXECUTE ON FUNCTION
  buzz.hide_dm(text, uuid), buzz.unhide_dm(text, uuid),
  buzz.reset_visibility(text), buzz.retry_visibility(text),
  buzz.visibility_lag(), buzz.visibility_lag_detail(integer), buzz.visibility_source(text),
  buzz.reminder_status(), buzz.next_reminder_wakeup(), buzz.fanout_status(),
  buzz.cfg(text), buzz.now_unix(), buzz.is_hex64(text), buzz.reject(text, text)
  TO buzz_operator;

-------------------------------------------------------------------------------------------------
-- Logical messages: the fan-out delivers what arrives under prefix 'buzz', so only the relay
-- role and the owners of the functions that emit them may write one. pg_logical_emit_message
-- belongs to the bootstrap superuser: a migrating role that is not a superuser cannot change its
-- grants (nor can rds_superuser on a managed service; REVOKE and GRANT would only warn), so the
-- change is made only when it can, and a NOTICE says when it was not.

DO $$
DECLARE
  f regprocedure;
  owner regrole;
  done boolean := false;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
            WHERE p.proname = 'pg_logical_emit_message'
              AND p.pronamespace = 'pg_catalog'::regnamespace
              AND pg_catalog.pg_has_role(p.proowner, 'USAGE') LOOP
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO buzz_relay', f);
    FOR owner IN SELECT DISTINCT p.proowner::regrole FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = 'buzz'::regnamespace LOOP
      EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', f, owner);
    END LOOP;
    done := true;
  END LOOP;
  IF NOT done THEN
    RAISE NOTICE 'pg_logical_emit_message stays executable by PUBLIC: only its owner (the bootstrap superuser) may revoke that';
  END IF;
END $$;
