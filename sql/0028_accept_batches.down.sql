-- Back to 0027: one event per call (buzz.accept_event) only.

DROP FUNCTION buzz.accept_events(jsonb, integer);
