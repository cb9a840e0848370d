package main

import "testing"

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
