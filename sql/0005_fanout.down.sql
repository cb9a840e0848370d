DROP FUNCTION IF EXISTS buzz.fanout_status();
DROP FUNCTION IF EXISTS buzz.reap_instances(interval);
DROP FUNCTION IF EXISTS buzz.instance_heartbeat(text, text, text);
