// Package metrics holds every Prometheus collector buzzpg exports at /metrics, in one place so an
// operator can read the list. Components increment them; serve exposes the default registry.
package metrics

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

var (
	// EventsAccepted counts EVENT verdicts by OK prefix: "accepted", "duplicate", "invalid",
	// "restricted", "blocked", "auth-required", "rate-limited", "error".
	EventsAccepted = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_events_total", Help: "EVENT messages by verdict (OK prefix).",
	}, []string{"verdict"})
	AcceptSeconds = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_accept_seconds", Help: "Time to store one EVENT (waiting for its batch included).",
		Buckets: prometheus.ExponentialBuckets(0.0002, 2, 14),
	})
	// AcceptBatchEvents is the number of events per buzz.accept_events call (group commit):
	// 1 when the relay is idle, more when events arrive while others are being stored.
	AcceptBatchEvents = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_accept_batch_events", Help: "Events per buzz.accept_events call.",
		Buckets: []float64{1, 2, 4, 8, 16, 32, 60},
	})
	// AcceptCallSeconds is one buzz.accept_events call from the relay's side: its round trip, the
	// commit's WAL flush included. AcceptCallsInFlight is how many run now (BUZZ_ACCEPT_BATCH_CALLS
	// bounds it): calls rarely in flight under load mean the relay, not PostgreSQL, is the limit.
	AcceptCallSeconds = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_accept_call_seconds", Help: "Duration of buzz.accept_events calls.",
		Buckets: []float64{.001, .002, .005, .01, .02, .05, .1, .25, .5, 1, 2.5},
	})
	AcceptCallsInFlight = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_accept_calls_in_flight", Help: "buzz.accept_events calls running now.",
	})
	// EventWindowDepth is a connection's EVENTs read and not yet answered, seen as each one joins
	// its window (relay/pipeline.go): 1 for a client that waits for each OK.
	EventWindowDepth = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_event_window_depth", Help: "EVENTs in a connection's window as one more joins it.",
		Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
	})
	// AcceptBatchFallbacks counts calls PostgreSQL refused as a whole, by SQLSTATE (55P03 a lock
	// wait over the bound, 40P01 a deadlock, ...), whose events were then stored one by one.
	AcceptBatchFallbacks = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_accept_batch_fallbacks_total", Help: "buzz.accept_events calls retried event by event, by reason.",
	}, []string{"reason"})
	Connections = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_connections", Help: "Open WebSocket connections.",
	})
	ConnectionsRefused = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_connections_refused_total", Help: "WebSocket upgrades refused by the connection caps, by reason (relay_full, per_ip).",
	}, []string{"reason"})
	Subscriptions = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_subscriptions", Help: "Live subscriptions across connections.",
	})
	SlowClientsClosed = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_slow_clients_closed_total", Help: "Connections closed for not reading: their send queue overflowed (overflow), their client's queues together passed its share of the send budget (client_share), every queue together passed the budget (send_budget), a write to them timed out (write_timeout), or live deliveries waited to be matched past their inbox's bound (inbox) or their client's (ip_inbox).",
	}, []string{"reason"})
	SubscriptionsRefused = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_subscriptions_refused_total", Help: "REQs CLOSED restricted: for a bound on live subscriptions: the connection's (connection), its filter values (filter_values), its client IP's across connections (ip), or the process's (process).",
	}, []string{"bound"})
	// Fair delivery and the process-wide bounds (issue 29, findings 4 and 5).
	DeliveryInbox = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_delivery_inbox", Help: "Live deliveries waiting in connections' inboxes to be matched against their subscriptions (bounded by BUZZ_INBOX_EVENTS and BUZZ_IP_INBOX_EVENTS).",
	})
	DeliveryThrottled = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_delivery_throttled_total", Help: "Times a connection's live deliveries waited because its client IP had spent its delivery budget (BUZZ_IP_DELIVERY_RATE).",
	})
	DedupBytes = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_dedup_bytes", Help: "Approximate bytes held by the subscriptions' de-duplication windows (bounded by BUZZ_DEDUP_MB).",
	})
	// SendQueuedBytes is what waits in the connections' send queues (live events, replies and
	// initial results not yet written to a socket): what the send budget bounds. Read from the
	// relay's own count when scraped (SetSendQueued), not kept up to date on every push.
	SendQueuedBytes = promauto.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "buzz_send_queued_bytes", Help: "Bytes waiting in send queues across connections (bounded by BUZZ_SEND_BUDGET_MB).",
	}, func() float64 {
		if f := sendQueued.Load(); f != nil {
			return float64((*f)())
		}
		return 0
	})
	RateLimited = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_rate_limited_total", Help: "Messages answered rate-limited:, by verb.",
	}, []string{"verb"})
	// InitialBytes is what REQ initial results hold in memory until sent, across connections;
	// InitialTruncated counts answers cut short: at the per-query bound ("query"), at the
	// connection's or the client IP's share of the budget ("connection", "ip"), or because the
	// process-wide budget was spent ("budget").
	InitialBytes = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_initial_result_bytes", Help: "Bytes of REQ initial results held in memory until sent.",
	})
	InitialTruncated = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_initial_results_truncated_total", Help: "REQ initial answers cut short, by bound (query, connection, ip, budget; connection, ip and budget also count REQs refused busy).",
	}, []string{"bound"})
	Queries = promauto.NewHistogramVec(prometheus.HistogramOpts{
		Name: "buzz_query_seconds", Help: "REQ/COUNT initial query time.",
		Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
	}, []string{"verb"})
	MemberLookupRetries = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_member_lookup_retries_total", Help: "Failed DM member-set lookups for live delivery, each retried (the replication stream waits meanwhile).",
	})
	// MemberEditUnseenSeconds: member lookups wait (fail closed) while an announced member edit is
	// invisible, which lasts as long as a synchronous standby does not answer.
	MemberEditUnseenSeconds = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_member_edit_unseen_seconds", Help: "At the last DM member lookup, how long the oldest announced member edit it did not see yet had been waiting (0: it saw them all); lookups wait for it.",
	})

	// Fan-out (logical replication).
	FanoutDelivered = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_fanout_events_total", Help: "Events decoded from the replication stream, by source (insert, ephemeral, due).",
	}, []string{"source"})
	FanoutRejected = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_fanout_messages_rejected_total", Help: "Logical messages, or events in them, the fan-out ignored, by reason (malformed, bad_id, bad_signature).",
	}, []string{"reason"})
	FanoutReconnects = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_fanout_reconnects_total", Help: "Replication stream reconnects.",
	})

	// Visibility snapshots (outbox + fenced publisher).
	OutboxDepth = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_visibility_pending_viewers", Help: "Viewers whose target generation is ahead of the published one.",
	})
	OutboxOldestSeconds = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_visibility_oldest_pending_seconds", Help: "Age of the oldest pending visibility change.",
	})
	Publications = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_snapshot_publications_total", Help: "Snapshot publications by outcome (published, stale, retry, failed).",
	}, []string{"outcome"})
	// SnapshotClaimViewers is the number of viewers per non-empty outbox claim: each claim and
	// its publication are one transaction each, so small claims under load mean many commits.
	SnapshotClaimViewers = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_snapshot_claim_viewers", Help: "Viewers per non-empty visibility outbox claim (published together).",
		Buckets: []float64{1, 2, 4, 8, 16, 32},
	})
	ConvergeSeconds = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_snapshot_converge_seconds", Help: "From the visibility change to the published snapshot.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
	})

	// Reminders.
	ReminderClaims = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_reminder_claims_total", Help: "Reminder claim outcomes (claimed, confirmed, rolled_back, lost, recovered, failed).",
	}, []string{"outcome"})
	ReminderLateness = promauto.NewHistogram(prometheus.HistogramOpts{
		Name: "buzz_reminder_lateness_seconds", Help: "Due signal emitted minus not_before.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
	})
	ReminderDueDelivered = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_reminder_due_delivered_total", Help: "Due signals handed to connections of this process.",
	})
)

// Export every known label value from the start, so a scrape shows zeros instead of nothing and
// rate() works from the first sample.
func init() {
	for _, v := range []string{"accepted", "duplicate", "invalid", "restricted", "blocked", "auth-required", "rate-limited", "error"} {
		EventsAccepted.WithLabelValues(v)
	}
	for _, v := range []string{"published", "stale", "retry", "failed"} {
		Publications.WithLabelValues(v)
	}
	for _, v := range []string{"claimed", "confirmed", "rolled_back", "lost", "recovered", "failed"} {
		ReminderClaims.WithLabelValues(v)
	}
	for _, v := range []string{"insert", "ephemeral", "due"} {
		FanoutDelivered.WithLabelValues(v)
	}
	for _, v := range []string{"malformed", "bad_id", "bad_signature"} {
		FanoutRejected.WithLabelValues(v)
	}
	for _, v := range []string{"EVENT", "AUTH", "REQ", "COUNT"} {
		RateLimited.WithLabelValues(v)
	}
	for _, v := range []string{"query", "connection", "ip", "budget"} {
		InitialTruncated.WithLabelValues(v)
	}
	for _, v := range []string{"connection", "filter_values", "ip", "process"} {
		SubscriptionsRefused.WithLabelValues(v)
	}
	for _, v := range []string{"overflow", "client_share", "send_budget", "write_timeout", "inbox", "ip_inbox"} {
		SlowClientsClosed.WithLabelValues(v)
	}
}

// RegisterFanout exports the replication stream's state, read at scrape time.
func RegisterFanout(ready func() bool, lag func() time.Duration) {
	promauto.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "buzz_fanout_attached", Help: "1 while the replication stream is attached.",
	}, func() float64 {
		if ready() {
			return 1
		}
		return 0
	})
	promauto.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "buzz_fanout_lag_seconds", Help: "Now minus the commit time of the last transaction handed to connections.",
	}, func() float64 { return lag().Seconds() })
}

var sendQueued atomic.Pointer[func() int64]

// SetSendQueued names what buzz_send_queued_bytes reports: the relay's count of queued bytes (the
// last relay set up in this process, which in production is the only one).
func SetSendQueued(f func() int64) { sendQueued.Store(&f) }

// Upkeep (listener/upkeep): the background purge, run by one process of the deployment at a time.
var (
	UpkeepRowsPurged = promauto.NewCounterVec(prometheus.CounterOpts{
		Name: "buzz_upkeep_rows_purged_total", Help: "Rows the upkeep purge removed, by rule (expired, reminders, retention:<name>).",
	}, []string{"rule"})
	UpkeepRuns = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_upkeep_runs_total", Help: "Complete upkeep passes this process ran while holding the upkeep lock.",
	})
	UpkeepLastRun = promauto.NewGauge(prometheus.GaugeOpts{
		Name: "buzz_upkeep_last_run_timestamp_seconds", Help: "Unix time this process last completed an upkeep pass (0: never).",
	})
	UpkeepErrors = promauto.NewCounter(prometheus.CounterOpts{
		Name: "buzz_upkeep_errors_total", Help: "Upkeep passes that ended in an error (the lock is given up; the next pass retries).",
	})
)
