package relay

import "encoding/hex"

// hexInto decodes s into all of dst; false unless s is exactly that many bytes of hex. The length
// is checked first: hex.Decode writes past a short dst.
func hexInto(dst []byte, s string) bool {
	if len(s) != 2*len(dst) {
		return false
	}
	_, err := hex.Decode(dst, []byte(s))
	return err == nil
}
