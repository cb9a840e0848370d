DROP TRIGGER members_truncated ON buzz.members;
DROP TRIGGER members_moved ON buzz.members;
DROP TRIGGER members_deleted ON buzz.members;
DROP TRIGGER members_inserted ON buzz.members;
DROP FUNCTION buzz.members_changed();
DROP FUNCTION buzz.fanout_status();
DROP FUNCTION buzz.reap_instances(interval);
DROP FUNCTION buzz.instance_heartbeat(text, text, text);
