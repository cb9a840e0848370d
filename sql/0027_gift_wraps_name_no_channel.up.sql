-- 0027: a gift wrap (1059) carrying an h tag is refused (found in review).
--
-- PROTOCOL.md's read gates give an event with an h tag naming a DM to the DM's members, and a
-- gift wrap to the pubkey in its p tag. accept_event gave such a wrap scope 'p', so its recipient
-- read it without being a member of the channel it named, and a member who was not its recipient
-- did not; `{"kinds":[1059],"#h":[<dm>]}` from that recipient was closed 'restricted:' although a
-- readable row matched. Nothing confidential leaked (the sender chose the recipient), but the two
-- gates disagreed. A NIP-59 wrap names its recipient only, so a wrap with an h tag is refused,
-- with the relay's words (relay/event.go, which refuses it before calling accept_event).
--
-- A trigger on the table, not a new accept_event: it holds for every writer (accept_event, and a
-- hand-written INSERT), and accept_event stays as 0024 left it. Its WHEN clause is evaluated by
-- the executor, so other rows run no PL/pgSQL. From psql, a wrap whose h names no channel the
-- sender is a member of is refused by accept_event's channel checks first ('restricted:'), as
-- before. Wraps stored that way before stay stored, readable by their recipient:
-- `SELECT id FROM buzz.events WHERE kind = 1059 AND h IS NOT NULL` lists them.

CREATE FUNCTION buzz.events_gift_wrap_channel_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.reject('BZ400', 'invalid: a gift wrap names no channel (h tag); it is read by its recipient (p tag) only');
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.events_gift_wrap_channel_guard() IS
  'Trigger (BEFORE INSERT on events, for kind 1059 with an h tag): refuses the row with BZ400 (invalid:): members of the channel and the recipient would both have a claim to read it (0027).';
CREATE TRIGGER events_gift_wrap_channel_guard BEFORE INSERT ON buzz.events
  FOR EACH ROW WHEN (NEW.kind = 1059 AND NEW.h IS NOT NULL)
  EXECUTE FUNCTION buzz.events_gift_wrap_channel_guard();
