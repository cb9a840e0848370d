-- Due signals of a batch confirm travel 100 to a logical message instead of one per message.
--
-- A burst of 10,000 due reminders used to emit 10,000 'buzz' messages. Every relay process's
-- walsender sends each message with its own send() and every relay wakes to read each one, so
-- on a 2-core server the burst was bound by system calls and context switches (about 45 % system
-- time, 30,000-47,000 switches/s), not by the claims. The batch confirm now emits one
-- transactional message per 100 signals of the batch:
--
--   {"t":"dues","scope":"a","items":[{"ev":<the 30300>,"stamp":<stamp>}, ...]}
--
-- It is still transactional (it exists iff the confirm commits, so each signal is emitted once per
-- stamp), and relays still de-duplicate each item by (event id, stamp). The single-row
-- confirm_reminder_claim keeps its one-signal "due" message.

CREATE OR REPLACE FUNCTION buzz.confirm_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  flipped text[];
  emitted text[];
  items   text[];
  i       integer;
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    RAISE EXCEPTION 'confirm_reminder_claims: % ids but % stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0);
  END IF;
  -- One set-based statement flips the rows still claimed under the given stamps (the fence) and
  -- renders the signal of each whose stored version still exists. Rows are locked in the order
  -- the planner visits them; callers pass ids sorted. The only overlap between two batches is a
  -- stale claimer and its recoverer; should they deadlock, one gets 40P01 and, being a plain
  -- error, emits nothing. Items are rendered as json text, not jsonb: aggregating a megabyte of
  -- jsonb doubled the cost of a 1,000-row confirm.
  WITH c AS (
    UPDATE buzz.reminders x
       SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
      FROM unnest(p_ids, p_stamps) AS u(id, stamp)
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.stamp
  )
  SELECT array_agg(c.id),
         array_agg(c.id) FILTER (WHERE e.id IS NOT NULL),
         array_agg(json_build_object(
             'ev', json_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                                     'tags', e.tags, 'content', e.content, 'sig', e.sig),
             'stamp', c.stamp)::text) FILTER (WHERE e.id IS NOT NULL)
    INTO flipped, emitted, items
    FROM c LEFT JOIN buzz.events e ON e.id = c.id;
  -- One message per 100 signals: a hundredth of the walsender and relay wake-ups of one message
  -- per signal, and messages small enough to decode without a megabyte buffer.
  FOR i IN 1 .. coalesce(array_length(items, 1), 0) BY 100 LOOP
    PERFORM pg_logical_emit_message(true, 'buzz',
      '{"t":"dues","scope":"a","items":[' || array_to_string(items[i:i + 99], ',') || ']}');
  END LOOP;
  -- A flipped row whose stored version is gone (removed by hand) had nothing to deliver.
  IF coalesce(array_length(flipped, 1), 0) > coalesce(array_length(emitted, 1), 0) THEN
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), confirmed_at = NULL
     WHERE id = ANY (flipped) AND NOT (id = ANY (coalesce(emitted, '{}')));
  END IF;
  RETURN QUERY SELECT unnest(coalesce(emitted, '{}'));
END $$;
COMMENT ON FUNCTION buzz.confirm_reminder_claims(text[], bigint[]) IS
  'Batch confirm_reminder_claim: for each (id, stamp) pair still claimed under that stamp, marks it confirmed and '
  'emits its due signal, all in the caller''s transaction, as transactional logical messages ''buzz'' of up to 100 '
  'signals each: {"t":"dues","scope":"a","items":[{"ev":<the 30300>,"stamp":..}, ...]}. Returns the confirmed ids. '
  'Pairs with a stale stamp emit nothing.';
