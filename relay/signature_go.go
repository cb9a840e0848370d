//go:build !libsecp256k1

package relay

import (
	"encoding/hex"

	"github.com/btcsuite/btcd/btcec/v2/schnorr"
	"github.com/nbd-wtf/go-nostr"
)

// verifySignature reports whether ev.Sig is ev.PubKey's BIP-340 signature of ev.ID, in pure Go
// (builds with libsecp256k1 use signature_secp.go, several times faster). As there, the caller has
// checked that the id hashes the event.
func verifySignature(ev *nostr.Event) bool {
	msg, err := hex.DecodeString(ev.ID)
	if err != nil || len(msg) != 32 {
		return false
	}
	raw, err := hex.DecodeString(ev.PubKey)
	if err != nil {
		return false
	}
	pk, err := schnorr.ParsePubKey(raw)
	if err != nil {
		return false
	}
	sb, err := hex.DecodeString(ev.Sig)
	if err != nil {
		return false
	}
	sig, err := schnorr.ParseSignature(sb)
	if err != nil {
		return false
	}
	return sig.Verify(msg, pk)
}
