-- Back to 0026: a gift wrap with an h tag is stored, readable by its p recipient.

DROP TRIGGER events_gift_wrap_channel_guard ON buzz.events;
DROP FUNCTION buzz.events_gift_wrap_channel_guard();
