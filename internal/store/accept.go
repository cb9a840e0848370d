// Package store is the Go side of buzz.accept_event: one call, one transaction, one verdict.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
)

// Prefixes for the buzz SQLSTATEs accept_event raises (sql/0002_accept.up.sql). buzz.accept_events
// (same file) catches exactly the codes of this map and of sqlstateMessage; a test compares them.
var sqlstatePrefix = map[string]string{
	"BZ400": "invalid: ",
	"BZ401": "auth-required: ",
	"BZ403": "restricted: ",
	"BZ409": "blocked: ",
	"BZ429": "rate-limited: ",
	"22P05": "invalid: ", // untranslatable character (NUL) in jsonb
	"22P02": "invalid: ",
	"22003": "invalid: ",
}

// Client errors whose PostgreSQL message would mean nothing to a client (or name our indexes).
var sqlstateMessage = map[string]string{
	// program_limit_exceeded: an index entry over PostgreSQL's limit (a btree row over 2704 bytes
	// for a d tag, a GIN entry for a tag value that does not compress). Retrying cannot help.
	"54000": "invalid: a tag value is too long to store",
}

const acceptSQL = `SELECT ok, message FROM buzz.accept_event($1::jsonb)`

// ClientError maps a rejected acceptance to the OK message the client should see. ok is false
// when err is not a client error (the caller answers "error: ..." and logs it).
func ClientError(err error) (message string, ok bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return "", false
	}
	return clientMessage(pgErr.Code, pgErr.Message)
}

// clientMessage is ClientError for an SQLSTATE and message (accept_events returns them as rows).
func clientMessage(code, msg string) (string, bool) {
	if fixed, ok := sqlstateMessage[code]; ok {
		return fixed, true
	}
	prefix, known := sqlstatePrefix[code]
	if !known {
		return "", false
	}
	if strings.HasPrefix(msg, strings.TrimSpace(prefix)) {
		return msg, true
	}
	return prefix + msg, true
}

// Accept runs buzz.accept_event for a verified event and returns the OK verdict. Deadlocks and
// serialization failures are retried (the event is idempotent by id). err is non-nil only for
// failures that are not the client's: the caller answers `OK false "error: ..."`.
func Accept(ctx context.Context, pool *pgxpool.Pool, ev *nostr.Event) (ok bool, message string, err error) {
	raw, err := json.Marshal(ev)
	if err != nil {
		return false, "invalid: cannot encode event", nil
	}
	return AcceptJSON(ctx, pool, raw)
}

// AcceptJSON is Accept for an already encoded event.
func AcceptJSON(ctx context.Context, pool *pgxpool.Pool, raw []byte) (ok bool, message string, err error) {
	err = db.Retry(ctx, func(ctx context.Context) error {
		return pool.QueryRow(ctx, acceptSQL, string(raw)).Scan(&ok, &message)
	})
	if err != nil {
		if msg, isClient := ClientError(err); isClient {
			return false, msg, nil
		}
		return false, "", err
	}
	return ok, canonicalResponse(message), nil
}

// canonicalResponse writes a DM command's reply the way docs/protocol.md shows it,
// response:{"channel_id":"<uuid>","created":<bool>}: accept_event builds it as jsonb, whose text
// puts the shorter key first and spaces after colons, and a client may match the string.
func canonicalResponse(msg string) string {
	body, ok := strings.CutPrefix(msg, "response:")
	if !ok {
		return msg
	}
	var r struct {
		ChannelID *string `json:"channel_id"`
		Created   *bool   `json:"created"`
	}
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	if dec.Decode(&r) != nil || r.ChannelID == nil || r.Created == nil {
		return msg // not the DM reply's shape: leave it as SQL wrote it
	}
	out, _ := json.Marshal(struct {
		ChannelID string `json:"channel_id"`
		Created   bool   `json:"created"`
	}{*r.ChannelID, *r.Created})
	return "response:" + string(out)
}
