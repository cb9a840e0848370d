package main

import (
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/listener/upkeep"
)

func TestDefaultRelayURL(t *testing.T) {
	for _, c := range []struct{ listen, bound, want string }{
		{"127.0.0.1:7777", "127.0.0.1:7777", "ws://127.0.0.1:7777"},
		{"localhost:7777", "127.0.0.1:7777", "ws://localhost:7777"}, // as the operator wrote it
		{"relay.example.com:80", "10.0.0.5:80", "ws://relay.example.com:80"},
		{"127.0.0.1:0", "127.0.0.1:40123", "ws://127.0.0.1:40123"}, // port 0: the chosen port
		{"[::1]:7777", "[::1]:7777", "ws://[::1]:7777"},
		{":7777", "[::]:7777", ""}, // wildcard: the relay takes the Host header
		{"0.0.0.0:7777", "[::]:7777", ""},
		{"[::]:7777", "[::]:7777", ""},
	} {
		if got := defaultRelayURL(c.listen, c.bound); got != c.want {
			t.Errorf("defaultRelayURL(%q, %q) = %q, want %q", c.listen, c.bound, got, c.want)
		}
	}
}

func TestMaxFutureSecondsMustBePositive(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://localhost/x")
	for _, v := range []string{"0", "-5"} {
		if _, err := parseServeConfig([]string{"--max-future-seconds", v}); err == nil {
			t.Errorf("--max-future-seconds %s accepted", v)
		}
	}
	if c, err := parseServeConfig([]string{"--max-future-seconds", "60"}); err != nil || c.MaxFutureSeconds != 60 {
		t.Errorf("--max-future-seconds 60: %v, %d", err, c.MaxFutureSeconds)
	}
}

func TestServeEnvironmentIsParsedStrictly(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://localhost/x")
	t.Setenv("BUZZ_AUTO_MIGRATE", "off") // what an operator writes for rolling deploys
	c, err := parseServeConfig(nil)
	if err != nil || c.AutoMigrate {
		t.Fatalf("BUZZ_AUTO_MIGRATE=off: auto-migrate %v, err %v", c.AutoMigrate, err)
	}
	for _, c := range []struct{ name, val string }{
		{"BUZZ_AUTO_MIGRATE", "maybe"},
		{"BUZZ_LEASE", "5"},
		{"BUZZ_LEASE", "61m"},
		{"BUZZ_REMINDER_LEASE", "2h"},
		{"BUZZ_MAX_FUTURE_SECONDS", "15m"},
		{"BUZZ_EVENT_RATE", "fast"},
		{"BUZZ_ACCEPT_CONNS", "-1"},
		{"BUZZ_QUERY_CONNS", "0"},
		{"BUZZ_ACCEPT_BATCH", "0"},
		{"BUZZ_ACCEPT_BATCH", "121"}, // accept_events takes at most 120
		{"BUZZ_ACCEPT_BATCH_CALLS", "0"},
		{"BUZZ_ACCEPT_BATCH_CALLS", "17"}, // more than BUZZ_ACCEPT_CONNS' default
		{"BUZZ_MAX_CONNS", "0"},
		{"BUZZ_IP_MAX_CONNS", "none"},
		{"BUZZ_REMINDER_HORIZON", "0s"},
		{"BUZZ_SLOT_STALE_AFTER", "1ms"},
		{"BUZZ_SWEEP_INTERVAL", "-1s"},
		{"BUZZ_SHUTDOWN_GRACE", "-1s"},
		{"BUZZ_IP_EVENT_RATE", "-5"},
		{"BUZZ_REQ_BURST", "0"},
		{"BUZZ_REMINDER_BATCH", "0"},
		{"BUZZ_REMINDER_BATCH", "100001"},
		{"BUZZ_REMINDER_BATCH", "2147483648"}, // claim_due_reminders takes an integer
		{"BUZZ_LOG_LEVEL", "verbose"},
		{"BUZZ_LOG_FORMAT", "yaml"},
		{"BUZZ_TRUSTED_PROXIES", "10.0.0.0/8, lb.internal"},
		{"BUZZ_RESULT_BUDGET_MB", "0"},
		{"BUZZ_RESULT_IP_SHARE_MB", "-1"},
		{"BUZZ_SEND_BUDGET_MB", "0"},
		{"BUZZ_IP_MAX_SUBSCRIPTIONS", "0"},
		{"BUZZ_MAX_SUBSCRIPTIONS", "0"},
		{"BUZZ_DEDUP_MB", "0"},
		{"BUZZ_INBOX_EVENTS", "-1"},
		{"BUZZ_IP_INBOX_EVENTS", "0"},
		{"BUZZ_SEND_BUDGET_MB", "3"},
		{"BUZZ_SEND_IP_SHARE_MB", "-1"},
		{"BUZZ_SEND_IP_SHARE_MB", "2048"},                  // more than the 1024 MiB budget
		{"BUZZ_MAX_FUTURE_SECONDS", "9223372036854775807"}, // now + it overflows, here and in accept_event
		{"BUZZ_MAX_FUTURE_SECONDS", "315360001"},
		{"BUZZ_QUERY_TIMEOUT", "600h"}, // beyond statement_timeout's range: every REQ would fail
		{"BUZZ_QUERY_TIMEOUT", "61m"},
		{"BUZZ_EVENT_RATE", "NaN"}, // passes "< 0", then breaks NIP-11's JSON
		{"BUZZ_IP_REQ_RATE", "Inf"},
		{"BUZZ_METRICS_LISTEN", "127.0.0.1:7777"}, // the same as BUZZ_LISTEN's default
		{"BUZZ_DEBUG_LISTEN", "127.0.0.1:7777"},
		{"BUZZ_UPKEEP_INTERVAL", "1ms"},
		{"BUZZ_UPKEEP_BATCH", "0"},
		{"BUZZ_UPKEEP_BATCH", "10001"},
		{"BUZZ_UPKEEP_GRACE", "-1s"},
		{"BUZZ_UPKEEP_PAUSE", "-1ms"},
		{"BUZZ_UPKEEP_PAUSE", "61s"},
		{"BUZZ_UPKEEP_REMINDER_KEEP", "soon"},
		{"BUZZ_UPKEEP_REMINDER_KEEP", "876001h"}, // past ten years
	} {
		t.Run(c.name+"="+c.val, func(t *testing.T) {
			t.Setenv(c.name, c.val)
			if _, err := parseServeConfig(nil); err == nil || !strings.Contains(err.Error(), c.name) {
				t.Fatalf("%s=%q: err %v, want one naming the variable", c.name, c.val, err)
			}
		})
	}
	// The bounds themselves are fine.
	t.Setenv("BUZZ_LEASE", "1h")
	t.Setenv("BUZZ_REMINDER_LEASE", "1h")
	t.Setenv("BUZZ_REMINDER_BATCH", "100000")
	t.Setenv("BUZZ_ACCEPT_BATCH", "60")
	t.Setenv("BUZZ_ACCEPT_BATCH_CALLS", "16")
	t.Setenv("BUZZ_MAX_FUTURE_SECONDS", "315360000")
	t.Setenv("BUZZ_QUERY_TIMEOUT", "1h")
	t.Setenv("BUZZ_RESULT_IP_SHARE_MB", "16")
	if c, err := parseServeConfig(nil); err != nil || c.Lease != time.Hour || c.ReminderLease != time.Hour || c.ReminderBatch != 100000 || c.ResultIPShareMB != 16 {
		t.Fatalf("leases of 1h and a batch of 100000: %v (%s, %s, %d)", err, c.Lease, c.ReminderLease, c.ReminderBatch)
	}
}

// BUZZ_UPKEEP_PAUSE defaults to upkeep.DefaultPause, and 0 (no pause) stays 0 rather than
// falling back to the default.
func TestUpkeepPauseSetting(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://localhost/x")
	for val, want := range map[string]time.Duration{"": upkeep.DefaultPause, "0": 0, "0s": 0, "250ms": 250 * time.Millisecond, "1m": time.Minute} {
		t.Setenv("BUZZ_UPKEEP_PAUSE", val)
		if c, err := parseServeConfig(nil); err != nil || c.UpkeepPause != want {
			t.Errorf("BUZZ_UPKEEP_PAUSE=%q: pause %s, err %v; want %s", val, c.UpkeepPause, err, want)
		}
	}
}

func TestRelayKeyMustSign(t *testing.T) {
	for name, key := range map[string]string{
		"zero":        strings.Repeat("0", 64),
		"group order": "fffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141",
		"short":       "abcd",
		"not hex":     strings.Repeat("zz", 32),
	} {
		if _, _, err := loadRelayKey(key, ""); err == nil || !strings.Contains(err.Error(), "relay key") {
			t.Errorf("%s key: err %v, want a relay key error", name, err)
		}
	}
	if _, pk, err := loadRelayKey(strings.Repeat("0", 63)+"1", ""); err != nil || len(pk) != 64 {
		t.Fatalf("key 1: %v %q", err, pk)
	}
}

func TestTrustedProxiesParsed(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://localhost/x")
	t.Setenv("BUZZ_TRUSTED_PROXIES", "10.0.0.0/8, 192.0.2.7 ,2001:db8::/32,10.1.2.3/8")
	c, err := parseServeConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range c.TrustedProxies {
		got = append(got, p.String())
	}
	if want := "10.0.0.0/8 192.0.2.7/32 2001:db8::/32 10.0.0.0/8"; strings.Join(got, " ") != want {
		t.Fatalf("trusted proxies %v, want %s", got, want)
	}
}

// BUZZ_RELAY_URL is what NIP-42 AUTH events must name: one no client would sign (no scheme, an
// http(s) scheme, no host) is refused at start, naming the variable, not found out AUTH by AUTH.
func TestRelayURLMustBeAWebSocketURL(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://localhost/x")
	for _, bad := range []string{"relay.example.com", "relay.example.com:443", "https://relay.example.com",
		"http://127.0.0.1:7777", "wss://", "ws://:7777", "wss:relay.example.com", "wss://relay example.com", "ws://%zz"} {
		t.Run(bad, func(t *testing.T) {
			t.Setenv("BUZZ_RELAY_URL", bad)
			if _, err := parseServeConfig(nil); err == nil || !strings.Contains(err.Error(), "BUZZ_RELAY_URL") {
				t.Fatalf("BUZZ_RELAY_URL=%q: err %v, want one naming the variable", bad, err)
			}
			if _, err := parseServeConfig([]string{"--relay-url", bad}); err == nil {
				t.Fatalf("--relay-url %q accepted", bad)
			}
		})
	}
	for _, good := range []string{"wss://relay.example.com", "ws://127.0.0.1:7777", "WSS://Relay.Example.com/nostr/", "wss://[2001:db8::1]:8443"} {
		t.Setenv("BUZZ_RELAY_URL", good)
		if c, err := parseServeConfig(nil); err != nil || c.RelayURL != good {
			t.Errorf("BUZZ_RELAY_URL=%q: %v (kept %q)", good, err, c.RelayURL)
		}
	}
}
