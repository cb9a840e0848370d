DROP TRIGGER IF EXISTS members_truncated ON buzz.members;
DROP TRIGGER IF EXISTS members_moved ON buzz.members;
DROP TRIGGER IF EXISTS members_deleted ON buzz.members;
DROP TRIGGER IF EXISTS members_inserted ON buzz.members;
DROP FUNCTION IF EXISTS buzz.members_changed();
