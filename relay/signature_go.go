//go:build !libsecp256k1

package relay

import (
	"github.com/btcsuite/btcd/btcec/v2/schnorr"
	"github.com/nbd-wtf/go-nostr"
)

// SignatureVerifier names what checks signatures in this build (logged at start-up).
const SignatureVerifier = "pure Go (btcec): about 3x the CPU of libsecp256k1; build with its headers installed"

// verifySignature reports whether ev.Sig is ev.PubKey's BIP-340 signature of ev.ID, in pure Go
// (builds with libsecp256k1 use signature_secp.go, several times faster). As there, the caller has
// checked that the id hashes the event.
func verifySignature(ev *nostr.Event) bool {
	var msg, key [32]byte
	var sb [64]byte
	if !hexInto(msg[:], ev.ID) || !hexInto(key[:], ev.PubKey) || !hexInto(sb[:], ev.Sig) {
		return false
	}
	pk, err := schnorr.ParsePubKey(key[:])
	if err != nil {
		return false
	}
	sig, err := schnorr.ParseSignature(sb[:])
	return err == nil && sig.Verify(msg[:], pk)
}
