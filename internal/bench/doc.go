// Package bench is buzzpg's load and soak tooling: latency statistics, the `buzzpg bench`
// scenarios with their same-run SQL baselines, and a helper that runs `buzzpg serve` processes.
// Its connections are internal/wsclient's. The chaos soak (tests/chaos) uses the process helper too.
package bench
