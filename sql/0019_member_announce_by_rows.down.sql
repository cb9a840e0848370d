-- Back to 0014's members_changed (quiet when the channel row has our xmin).

CREATE OR REPLACE FUNCTION buzz.members_changed() RETURNS trigger
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
