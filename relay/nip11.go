package relay

import (
	"encoding/json"
	"net/http"
)

// nip11Doc is the NIP-11 relay information document. limitation lists every limit the relay
// enforces, including buzzpg's own (send_queue_bytes, max_filter_values, ...).
type nip11Doc struct {
	Name                string          `json:"name,omitempty"`
	Description         string          `json:"description,omitempty"`
	Pubkey              string          `json:"pubkey,omitempty"`
	Software            string          `json:"software"`
	Version             string          `json:"version"`
	SupportedNIPs       []int           `json:"supported_nips"`
	SupportedExtensions []string        `json:"supported_extensions"`
	Limitation          nip11Limitation `json:"limitation"`
}

type nip11Limitation struct {
	MaxMessageLength    int     `json:"max_message_length"`
	MaxSubscriptions    int     `json:"max_subscriptions"`
	MaxFilters          int     `json:"max_filters"`
	MaxLimit            int     `json:"max_limit"`
	DefaultLimit        int     `json:"default_limit"`
	MaxSubIDLength      int     `json:"max_subid_length"`
	MaxEventTags        int     `json:"max_event_tags"`
	MaxContentLength    int     `json:"max_content_length"`
	CreatedAtUpperLimit int64   `json:"created_at_upper_limit"`
	MinPowDifficulty    int     `json:"min_pow_difficulty"`
	AuthRequired        bool    `json:"auth_required"`
	PaymentRequired     bool    `json:"payment_required"`
	RestrictedWrites    bool    `json:"restricted_writes"`
	SendQueueBytes      int     `json:"send_queue_bytes"`
	MaxFilterValues     int     `json:"max_filter_values"`
	MaxConnFilterVals   int     `json:"max_connection_filter_values"`
	MaxQueriesInFlight  int     `json:"max_queries_in_flight"`
	QueryTimeoutMillis  int64   `json:"query_timeout_ms"`
	MaxAuthPubkeys      int     `json:"max_auth_pubkeys"`
	MaxDeletionTargets  int     `json:"max_deletion_targets"`
	ReminderHorizonSecs int64   `json:"reminder_horizon_seconds"`
	EventRate           float64 `json:"event_rate_per_second,omitempty"`
	EventBurst          int     `json:"event_burst,omitempty"`
	ReqRate             float64 `json:"req_rate_per_second,omitempty"`
	ReqBurst            int     `json:"req_burst,omitempty"`
	IPEventRate         float64 `json:"ip_event_rate_per_second,omitempty"`
	IPReqRate           float64 `json:"ip_req_rate_per_second,omitempty"`
}

// Version is reported in NIP-11; cmd may set it at link time.
var Version = "dev"

func (s *Server) buildNIP11() ([]byte, error) {
	c := s.cfg
	doc := nip11Doc{
		Name:                c.Name,
		Description:         c.Description,
		Pubkey:              s.relayPubkey,
		Software:            "https://github.com/buzzpg/buzzpg",
		Version:             Version,
		SupportedNIPs:       []int{1, 9, 11, 40, 42, 45, 70},
		SupportedExtensions: []string{"nip-dv", "nip-er"},
		Limitation: nip11Limitation{
			MaxMessageLength:    c.MaxMessageLength,
			MaxSubscriptions:    c.MaxSubscriptions,
			MaxFilters:          c.MaxFilters,
			MaxLimit:            c.MaxLimit,
			DefaultLimit:        c.DefaultLimit,
			MaxSubIDLength:      maxSubIDLength,
			MaxEventTags:        c.MaxEventTags,
			MaxContentLength:    c.MaxContentLength,
			CreatedAtUpperLimit: c.MaxFutureSeconds,
			SendQueueBytes:      c.SendQueueBytes,
			MaxFilterValues:     maxFilterValues,
			MaxConnFilterVals:   maxConnFilterValues,
			MaxQueriesInFlight:  c.MaxQueriesInFlight,
			QueryTimeoutMillis:  c.QueryTimeout.Milliseconds(),
			MaxAuthPubkeys:      maxAuthPubkeys,
			MaxDeletionTargets:  maxDeletionTargets,
			ReminderHorizonSecs: int64(c.ReminderHorizon.Seconds()),
			EventRate:           c.EventRate,
			ReqRate:             c.ReqRate,
			IPEventRate:         c.IPEventRate,
			IPReqRate:           c.IPReqRate,
		},
	}
	if c.EventRate > 0 || c.IPEventRate > 0 {
		doc.Limitation.EventBurst = c.EventBurst
	}
	if c.ReqRate > 0 || c.IPReqRate > 0 {
		doc.Limitation.ReqBurst = c.ReqBurst
	}
	return json.Marshal(doc)
}

func (s *Server) serveNIP11(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// NIP-11: browsers fetch this cross-origin.
	h.Set("Access-Control-Allow-Origin", "*")
	h.Set("Access-Control-Allow-Headers", "*")
	h.Set("Access-Control-Allow-Methods", "GET, OPTIONS")
	if r.Method == http.MethodOptions {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	h.Set("Content-Type", "application/nostr+json")
	_, _ = w.Write(s.nip11)
}
