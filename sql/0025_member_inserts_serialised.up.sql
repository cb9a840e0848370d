-- 0019 left a hole: two transactions inserting the first member rows of one channel at the same
-- time each saw only their own rows (the other's were not committed), so both stayed quiet. A
-- relay that looked the set up between the two commits cached the first one's members and never
-- learned of the second's, whose DMs then never reached them live. Inserters of one channel now
-- take a transaction-scoped advisory lock on it (sorted, before the check): the one that gets it
-- second waits for the first's commit and, checking with a fresh statement snapshot, sees its
-- rows and announces. Under REPEATABLE READ or SERIALIZABLE the snapshot is the transaction's and
-- could not see them, so an insert there always announces.

CREATE OR REPLACE FUNCTION buzz.members_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  chans text[];
  empty_chans text[];
  ins_chan text;
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
      IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Our snapshot is the transaction's: it cannot see a concurrent first inserter's rows
        -- even once they commit, so there is no telling an empty channel. Announce.
        SELECT array_agg(DISTINCT channel_id::text) INTO chans FROM members_new;
      ELSE
        SELECT coalesce(array_agg(ch::text) FILTER (WHERE others), '{}'),
               coalesce(array_agg(ch::text ORDER BY ch::text) FILTER (WHERE NOT others), '{}')
          INTO chans, empty_chans
          FROM (SELECT n.ch, EXISTS (SELECT 1 FROM buzz.members m
                                      WHERE m.channel_id = n.ch
                                        AND NOT EXISTS (SELECT 1 FROM members_new x
                                                         WHERE x.channel_id = m.channel_id AND x.pubkey = m.pubkey)) AS others
                  FROM (SELECT DISTINCT channel_id AS ch FROM members_new) n) s;
        -- A concurrent first insert into one of the channels that look empty would look the same
        -- to its own statement, and both would stay quiet. Their inserters take the channel's
        -- lock (sorted; only channels that look empty, so ordinary edits take none) and hold it
        -- to commit, then check again with a new snapshot: the second one sees the first's rows.
        FOREACH ins_chan IN ARRAY empty_chans LOOP
          PERFORM pg_advisory_xact_lock(hashtextextended('members:' || ins_chan, 0));
        END LOOP;
        chans := chans || ARRAY(SELECT e FROM unnest(empty_chans) e
                                 WHERE EXISTS (SELECT 1 FROM buzz.members m
                                                WHERE m.channel_id = e::uuid
                                                  AND NOT EXISTS (SELECT 1 FROM members_new x
                                                                   WHERE x.channel_id = m.channel_id AND x.pubkey = m.pubkey)));
        IF cardinality(chans) = 0 THEN
          chans := NULL;
        END IF;
      END IF;
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
  'Trigger: member rows were inserted, deleted, moved to another channel or pubkey, or truncated; tells every relay (a ''members'' logical message) to forget its cached member sets of those channels. Inserters of one channel serialise on a transaction-scoped advisory lock (''members:<channel id>'') so that concurrent first inserts cannot both stay quiet (0025).';
