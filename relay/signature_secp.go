//go:build libsecp256k1

package relay

/*
#cgo LDFLAGS: -lsecp256k1
#include <secp256k1.h>
#include <secp256k1_schnorrsig.h>
#include <secp256k1_extrakeys.h>
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/nbd-wtf/go-nostr"
)

// SignatureVerifier names what checks signatures in this build (logged at start-up).
const SignatureVerifier = "libsecp256k1"

// verifyCtx is libsecp256k1's context for verification; read-only once made, so shared.
var verifyCtx = C.secp256k1_context_create(C.SECP256K1_CONTEXT_VERIFY)

// parsedKeys keeps authors' parsed public keys: parsing one takes a square root, about a seventh of
// what a verification costs, and a team's authors post again and again. Bounded: when full it is
// emptied, which costs only the next parses.
var parsedKeys = struct {
	sync.Mutex
	m map[string]C.secp256k1_xonly_pubkey
}{m: map[string]C.secp256k1_xonly_pubkey{}}

const maxParsedKeys = 8192

// verifySignature reports whether ev.Sig is ev.PubKey's BIP-340 signature of ev.ID. The caller has
// checked the hex fields and that the id hashes the event (CheckID), so the id is the message:
// nostr.Event.CheckSignature would serialise and hash the event a second time.
func verifySignature(ev *nostr.Event) bool {
	var msg [32]byte
	var sig [64]byte
	if !hexInto(msg[:], ev.ID) || !hexInto(sig[:], ev.Sig) {
		return false
	}
	pk, ok := parsedKey(ev.PubKey)
	if !ok {
		return false
	}
	return C.secp256k1_schnorrsig_verify(verifyCtx, (*C.uchar)(unsafe.Pointer(&sig[0])),
		(*C.uchar)(unsafe.Pointer(&msg[0])), 32, &pk) == 1
}

// parsedKey returns the parsed form of a hex public key, from parsedKeys when it is there.
func parsedKey(pubkey string) (C.secp256k1_xonly_pubkey, bool) {
	parsedKeys.Lock()
	pk, ok := parsedKeys.m[pubkey]
	parsedKeys.Unlock()
	if ok {
		return pk, true
	}
	var raw [32]byte
	if !hexInto(raw[:], pubkey) {
		return pk, false
	}
	if C.secp256k1_xonly_pubkey_parse(verifyCtx, &pk, (*C.uchar)(unsafe.Pointer(&raw[0]))) != 1 {
		return pk, false // not a point on the curve: not kept
	}
	parsedKeys.Lock()
	if len(parsedKeys.m) >= maxParsedKeys {
		clear(parsedKeys.m)
	}
	parsedKeys.m[pubkey] = pk
	parsedKeys.Unlock()
	return pk, true
}
