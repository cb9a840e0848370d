package main

import (
	"log/slog"
	"net/http"
	"net/http/pprof"
	"time"
)

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
