-- Roles and grants. buzz_relay is what a relay's login role is a member of; buzz_operator what an
-- operator's is. Every function runs with its caller's rights (SECURITY INVOKER), so both roles
-- need the table rights the functions and the relay's own reads need. The operator role gets the
-- same: operators UPDATE member rows (a raw hide converges through the triggers), retry an
-- outbox row and reset a viewer by DELETE.
--
-- The functions that trust their caller's signature check are executable by these two roles only
-- (their REVOKE from PUBLIC sits next to each definition). What else a relay's login role needs
-- is outside the database's grants: the REPLICATION attribute (its slot, the stream, dropping
-- stale peers' slots) and a pg_hba.conf line for replication connections. Migrations need the
-- schema owner.

-- Roles are shared by every database of the cluster: created once, never dropped here.
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'buzz_relay') THEN
    CREATE ROLE buzz_relay NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'buzz_operator') THEN
    CREATE ROLE buzz_operator NOLOGIN;
  END IF;
END $$;

GRANT USAGE ON SCHEMA buzz TO buzz_relay, buzz_operator;

GRANT EXECUTE ON FUNCTION buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.accept_plain(buzz.events), buzz.accept_dm_message(buzz.events, text), buzz.accept_ephemeral(buzz.events),
  buzz.replace_head(buzz.events), buzz.accept_replaceable(buzz.events, text), buzz.accept_deletion(buzz.events),
  buzz.accept_gift_wrap(buzz.events, text), buzz.accept_reminder(buzz.events, text),
  buzz.accept_dm_command(buzz.events)
  TO buzz_relay, buzz_operator;
GRANT EXECUTE ON FUNCTION buzz.hide_dm(text, uuid), buzz.unhide_dm(text, uuid) TO buzz_operator, buzz_relay;
GRANT EXECUTE ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb),
                          buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
                          buzz.claim_visibility_work(uuid, integer, interval),
                          buzz.release_visibility_claim(text, uuid, text, interval, interval),
                          buzz.release_visibility_claims(uuid[]),
                          buzz.sweep_visibility(),
                          buzz.visibility_source(text),
                          buzz.visibility_lag(), buzz.visibility_lag_detail(integer)
  TO buzz_relay, buzz_operator;
GRANT EXECUTE ON FUNCTION buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.claim_due_reminders(integer, interval, boolean, text[]), buzz.rollback_reminder_claim(text, bigint, bigint),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.confirm_reminder_claim(text, bigint, bigint),
  buzz.confirm_reminder_claims(text[], bigint[]), buzz.reminder_status(), buzz.next_reminder_wakeup()
  TO buzz_relay, buzz_operator;

GRANT SELECT ON buzz_schema_migrations TO buzz_relay, buzz_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA buzz TO buzz_relay, buzz_operator;
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA buzz TO buzz_relay, buzz_operator;
-- Rows of visibility_retired are never deleted (a reset viewer's generations would repeat); its
-- trigger refuses it too.
REVOKE DELETE ON buzz.visibility_retired FROM buzz_relay, buzz_operator;
-- Tables and sequences a later migration creates get the same (migrations run as this owner).
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO buzz_relay, buzz_operator;
