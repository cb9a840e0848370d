DROP TRIGGER IF EXISTS visibility_state_check_lift ON buzz.visibility_state;
DROP TRIGGER IF EXISTS visibility_state_lift ON buzz.visibility_state;
DROP TRIGGER IF EXISTS visibility_state_retire_all ON buzz.visibility_state;
DROP TRIGGER IF EXISTS visibility_state_retire ON buzz.visibility_state;
DROP FUNCTION IF EXISTS buzz.visibility_state_check_lift();
DROP FUNCTION IF EXISTS buzz.visibility_state_lift();
DROP FUNCTION IF EXISTS buzz.visibility_state_retire_all();
DROP FUNCTION IF EXISTS buzz.visibility_state_retire();
DROP TABLE IF EXISTS buzz.visibility_retired;
