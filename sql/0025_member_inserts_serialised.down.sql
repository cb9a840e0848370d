-- Back to 0019's members_changed (no lock: concurrent first inserts into a channel stay quiet).

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
      -- A channel whose every member row this statement inserted (a DM open) has no cached set
      -- anywhere: an empty set is never cached, and a delete that emptied it was announced. Say
      -- nothing for it. Any other member row of the channel, however recently written, means a
      -- set may be cached.
      SELECT array_agg(DISTINCT n.channel_id::text) INTO chans
        FROM members_new n
       WHERE EXISTS (SELECT 1 FROM buzz.members m
                      WHERE m.channel_id = n.channel_id
                        AND NOT EXISTS (SELECT 1 FROM members_new x
                                         WHERE x.channel_id = m.channel_id AND x.pubkey = m.pubkey));
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
