package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// serveOps serves /metrics and a /readyz that says why on ln, the operator's private address
// (BUZZ_METRICS_LISTEN). ready is nil until the process has its pools.
func serveOps(ln net.Listener, ready *atomic.Pointer[func(context.Context) (string, error)], log *slog.Logger) *http.Server {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.Handler())
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		check := ready.Load()
		if check == nil {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		if reason, err := (*check)(r.Context()); reason != "" {
			if err != nil {
				reason += ": " + err.Error()
			}
			http.Error(w, reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 60 * time.Second}
	log.Info("metrics listening", "addr", ln.Addr().String())
	go func() {
		if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
			log.Warn("metrics listener stopped", "err", err)
		}
	}()
	return srv
}

// serveDebug exposes Go's profiler on its own address, never on the public relay listener:
// profiles reveal internals and a CPU profile costs CPU, so it is opt-in (--debug-listen) and
// meant for a private interface.
func serveDebug(addr string, log *slog.Logger) {
	if addr == "" {
		return
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		log.Info("debug profiles listening", "addr", addr)
		if err := srv.ListenAndServe(); err != nil {
			log.Warn("debug listener stopped", "addr", addr, "err", err)
		}
	}()
}
