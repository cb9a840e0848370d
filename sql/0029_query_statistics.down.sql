-- Back to 0028: statistics by autovacuum's defaults only.

DROP FUNCTION buzz.refresh_statistics();
ALTER TABLE buzz.members RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
ALTER TABLE buzz.events RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
