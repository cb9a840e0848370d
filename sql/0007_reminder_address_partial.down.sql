DROP INDEX buzz.reminders_address_idx;
CREATE INDEX reminders_address_idx ON buzz.reminders (pubkey, d_tag);
