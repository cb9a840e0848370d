// Package sql embeds buzzpg's migrations (golang-migrate layout: NNNN_name.up.sql/.down.sql).
// The stock migrate CLI can apply this folder as well: migrate -path sql -database pgx5://... up
package sql

import "embed"

// FS holds every migration file.
//
//go:embed *.sql
var FS embed.FS
