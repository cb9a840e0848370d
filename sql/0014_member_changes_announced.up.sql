-- Relays cache DM member sets for live delivery: a DM's participants never change through the
-- protocol (adding someone opens a new DM), so a set read once stays true. An operator can still
-- change member rows by hand (a key moved after a compromise, a member removed, a channel
-- deleted); without a word from the database the old key kept receiving that DM's live traffic
-- until every relay restarted. Each such change now emits a transactional logical message that
-- every relay receives in commit order, before any later event, and forgets those sets.
--
-- Payload: {"t":"members","channels":["<uuid>", ...]} or {"t":"members","all":true} (TRUNCATE).
-- Binaries that predate it skip the unknown type. Hides and resurfacing update hidden_at only,
-- and opening a DM inserts the members of a channel created in the same transaction: neither
-- emits anything.

CREATE FUNCTION buzz.members_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  chans text[];
BEGIN
  CASE TG_OP
    WHEN 'TRUNCATE' THEN
      PERFORM pg_logical_emit_message(true, 'buzz', '{"t":"members","all":true}');
      RETURN NULL;
    WHEN 'INSERT' THEN
      -- A channel this transaction created (a DM open) was never cached anywhere: say nothing.
      -- (Created in a subtransaction, its xmin differs and it is announced: harmless.)
      SELECT array_agg(DISTINCT n.channel_id::text) INTO chans
        FROM members_new n JOIN buzz.channels c ON c.id = n.channel_id
       WHERE c.xmin::text::numeric <> pg_current_xact_id()::text::numeric % 4294967296;
    WHEN 'DELETE' THEN
      SELECT array_agg(DISTINCT channel_id::text) INTO chans FROM members_old;
    ELSE
      chans := ARRAY(SELECT DISTINCT c FROM unnest(ARRAY[OLD.channel_id::text, NEW.channel_id::text]) c);
  END CASE;
  IF chans IS NOT NULL THEN
    PERFORM pg_logical_emit_message(true, 'buzz',
      jsonb_build_object('t', 'members', 'channels', to_jsonb(chans))::text);
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_changed() IS
  'Trigger: member rows were inserted, deleted, moved to another channel or pubkey, or truncated; tells every relay (a ''members'' logical message) to forget its cached member sets of those channels.';

CREATE TRIGGER members_inserted AFTER INSERT ON buzz.members
  REFERENCING NEW TABLE AS members_new FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();
CREATE TRIGGER members_deleted AFTER DELETE ON buzz.members
  REFERENCING OLD TABLE AS members_old FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();
CREATE TRIGGER members_moved AFTER UPDATE OF channel_id, pubkey ON buzz.members
  FOR EACH ROW WHEN ((OLD.channel_id, OLD.pubkey) IS DISTINCT FROM (NEW.channel_id, NEW.pubkey))
  EXECUTE FUNCTION buzz.members_changed();
CREATE TRIGGER members_truncated AFTER TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();
