-- The roles stay: other databases of the cluster may use them.
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  REVOKE USAGE, SELECT, UPDATE ON SEQUENCES FROM buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  REVOKE SELECT, INSERT, UPDATE, DELETE ON TABLES FROM buzz_relay, buzz_operator;
REVOKE USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE SELECT ON buzz_schema_migrations FROM buzz_relay, buzz_operator;
REVOKE EXECUTE ON FUNCTION buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.claim_due_reminders(integer, interval, boolean, text[]), buzz.rollback_reminder_claim(text, bigint, bigint),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.confirm_reminder_claim(text, bigint, bigint),
  buzz.confirm_reminder_claims(text[], bigint[]), buzz.reminder_status(), buzz.next_reminder_wakeup()
  FROM buzz_relay, buzz_operator;
REVOKE EXECUTE ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb),
                           buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
                           buzz.claim_visibility_work(uuid, integer, interval),
                           buzz.release_visibility_claim(text, uuid, text, interval, interval),
                           buzz.release_visibility_claims(uuid[]),
                           buzz.sweep_visibility(),
                           buzz.visibility_source(text),
                           buzz.visibility_lag(), buzz.visibility_lag_detail(integer)
  FROM buzz_relay, buzz_operator;
REVOKE EXECUTE ON FUNCTION buzz.hide_dm(text, uuid), buzz.unhide_dm(text, uuid) FROM buzz_operator, buzz_relay;
REVOKE EXECUTE ON FUNCTION buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.accept_plain(buzz.events), buzz.accept_dm_message(buzz.events, text), buzz.accept_ephemeral(buzz.events),
  buzz.replace_head(buzz.events), buzz.accept_replaceable(buzz.events, text), buzz.accept_deletion(buzz.events),
  buzz.accept_gift_wrap(buzz.events, text), buzz.accept_reminder(buzz.events, text),
  buzz.accept_dm_command(buzz.events)
  FROM buzz_relay, buzz_operator;
REVOKE USAGE ON SCHEMA buzz FROM buzz_relay, buzz_operator;
